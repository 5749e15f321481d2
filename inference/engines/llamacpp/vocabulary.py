"""The GGUF's tokenizer as clients may ask it (``/tokenize``, ``/detokenize``,
``/tokenizer_info``): llama.cpp's own tokenizing and detokenizing of the loaded vocabulary, and
its settings read from the GGUF's metadata. Only reads the vocabulary: callable from any thread
while the decoding thread decodes (llama.cpp's server tokenizes on its HTTP threads too)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp
from llama_cpp import Llama

from structured.reply import InvalidRequest


def tokenize(llm: Llama, text: str, add_special: bool, parse_special: bool) -> list[int]:
    tokens: list[int] = llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)
    return tokens


def detokenize(vocab: Any, n_vocab: int, tokens: list[int]) -> str:
    """llama.cpp's ``llama_detokenize``: the inverse of tokenizing (a SentencePiece vocabulary's
    leading space, added by tokenizing, is taken off again), special tokens spelled out. Bytes
    that are no UTF-8 (a character cut in two) become U+FFFD."""
    if outside := [t for t in tokens if not 0 <= t < n_vocab]:
        # llama.cpp does not check: an id outside the vocabulary would read past its tables.
        raise InvalidRequest(
            f"token {outside[0]} is outside the model's vocabulary of {n_vocab} tokens"
        )
    if not tokens:
        return ""
    ids = (llama_cpp.llama_token * len(tokens))(*tokens)
    size = 8 * len(tokens) + 16
    while True:
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, ids, len(tokens), buffer, size, False, True)
        if n >= 0:
            return buffer.raw[:n].decode(errors="replace")
        size = -n  # what it needs


def vocabulary_text(vocab: Any, n_vocab: int, token: int) -> str:
    if not 0 <= token < n_vocab:
        return ""
    return bytes(llama_cpp.llama_vocab_get_text(vocab, token)).decode(errors="replace")


def tokenizer_info(llm: Llama, vocab: Any, n_vocab: int, template: str | None) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` fields that a GGUF has: there, the Hugging Face tokenizer's
    settings (``tokenizer_config.json``); here the same names, from the GGUF's metadata. The
    class is llama.cpp's (``tokenizer_model``: the GGUF's ``tokenizer.ggml.model``, ``gpt2``
    for byte-level BPE, ``llama`` for SentencePiece)."""
    meta = llm.metadata
    info: dict[str, Any] = {
        "tokenizer_class": "LlamaCppTokenizer",
        "tokenizer_model": meta.get("tokenizer.ggml.model"),
        "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
        "bos_token": _text_of(vocab, int(llama_cpp.llama_vocab_bos(vocab))),
        "eos_token": _text_of(vocab, int(llama_cpp.llama_vocab_eos(vocab))),
        "pad_token": _text_of(vocab, _id(meta.get("tokenizer.ggml.padding_token_id"))),
        "unk_token": _text_of(vocab, _id(meta.get("tokenizer.ggml.unknown_token_id"))),
        "add_bos_token": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos_token": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "model_max_length": int(llama_cpp.llama_model_n_ctx_train(llm.model)),
        "vocab_size": n_vocab,
        "chat_template": template,
    }
    return {k: v for k, v in info.items() if v is not None}


def _id(value: str | None) -> int:
    try:
        return int(value) if value is not None else -1
    except ValueError:
        return -1


def _text_of(vocab: Any, token: int) -> str | None:
    if token < 0:
        return None
    return bytes(llama_cpp.llama_vocab_get_text(vocab, token)).decode(errors="replace")
