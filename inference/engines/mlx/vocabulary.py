"""An MLX model's tokenizer (Hugging Face's) as clients may ask it (``/tokenize``,
``/detokenize``, ``/tokenizer_info``), the way vLLM answers from the same tokenizer: encoding
and decoding by the tokenizer itself, and its settings as ``tokenizer_config.json`` has them.
Callable from a thread other than the one generating: nothing here changes the tokenizer."""

from __future__ import annotations

import threading
from typing import Any

from structured.reply import InvalidRequest

# Settings that name files on the runner's disk: not the client's business.
_PATHS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


class LiteralSpecials:
    """Encodes text with special tokens' texts read as plain text (llama.cpp's
    ``parse_special: false``). Hugging Face does it by switching the shared tokenizer's
    ``encode_special_tokens`` for the call, which a prompt encoded meanwhile on another thread
    would see; this switches a copy, made at the first use."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._copy: Any = None
        self._lock = threading.Lock()

    def encode(self, text: str, add_special: bool) -> list[int]:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequest("this model's tokenizer always reads special tokens in text")
        with self._lock:
            if self._copy is None:
                from tokenizers import Tokenizer

                self._copy = Tokenizer.from_str(backend.to_str())
                self._copy.encode_special_tokens = True
            return [int(t) for t in self._copy.encode(text, add_special_tokens=add_special).ids]


def decode(tokenizer: Any, size: int, tokens: list[int]) -> str:
    """The tokenizer's own decoding (special tokens kept, as vLLM's ``/detokenize``)."""
    if outside := [t for t in tokens if not 0 <= t < size]:
        raise InvalidRequest(f"token {outside[0]} is outside the model's vocabulary of {size}")
    return str(tokenizer.decode(tokens, skip_special_tokens=False))


def spelling(tokenizer: Any, size: int, token: int) -> str:
    name = tokenizer.convert_ids_to_tokens(token) if 0 <= token < size else None
    return name if isinstance(name, str) else ""


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """As vLLM's ``/tokenizer_info``: the tokenizer's own settings (``init_kwargs``: what
    ``tokenizer_config.json`` said, special tokens as their text), its class, and the chat
    template."""
    config = {k: v for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for name in _PATHS:
        config.pop(name, None)
    info: dict[str, Any] = {k: _json(v) for k, v in config.items()}
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        info["chat_template"] = chat_template
    return info


def _json(value: Any) -> Any:
    """A setting as JSON: an ``AddedToken`` as its text, containers item by item, anything
    else that JSON has no type for as its text."""
    if hasattr(value, "content"):
        return str(value.content)
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
