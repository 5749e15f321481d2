"""A tiny BERT cross-encoder GGUF with random weights and rank pooling, written with the
``gguf`` package: what the tests of reranking load, since no real reranker GGUF can be had
offline. It has the classifier head llama.cpp's rank pooling reads (``cls``, ``cls.output``:
``build_pooling``'s ``LLAMA_POOLING_TYPE_RANK``), so that it gives one score per query and
document pair; the scores are those of random weights: deterministic, different from one
document to another, and meaningless (no real reranker runs in these tests)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

ARCH = "bert"
N_EMBD, N_FF, N_LAYER, N_HEAD, N_CTX = 64, 128, 2, 4, 256
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [
    "the",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "kitten",
    "is",
    "sleeping",
    "rug",
    "stock",
    "markets",
    "fell",
    "sharply",
    "monday",
    "interest",
    "rates",
    "were",
    "raised",
    "by",
    "bank",
    "what",
    "where",
    "does",
    "sit",
    "dog",
    "chased",
    "ball",
    "in",
    "park",
    "weather",
    "note",
    "number",
    "about",
    "of",
    ".",
    "?",
    ",",
]
LETTERS = list("abcdefghijklmnopqrstuvwxyz0123456789")


def vocabulary() -> list[str]:
    """WordPiece tokens as llama.cpp's GGUF writes them: a word's first piece marked with a
    leading '▁', a continuation ('##ing') bare."""
    pieces = [*SPECIALS, *(f"\u2581{w}" for w in WORDS), *(f"\u2581{c}" for c in LETTERS)]
    return list(dict.fromkeys([*pieces, *LETTERS]))  # each once ('a' is a word and a letter)


def write_tiny_reranker(path: Path, seed: int = 0) -> Path:
    """The model, written to ``path`` (a few hundred KB, in well under a second)."""
    rng = np.random.default_rng(seed)
    tokens = vocabulary()

    def weights(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("tiny-random-reranker")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_block_count(N_LAYER)
    w.add_head_count(N_HEAD)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_token_type_count(2)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_pad_token_id(0)
    w.add_unk_token_id(1)
    w.add_bos_token_id(2)  # [CLS]
    w.add_sep_token_id(3)
    w.add_mask_token_id(4)
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_add_eos_token(False)

    # numpy shapes are GGUF's reversed: a {n_embd, n_vocab} tensor is (n_vocab, n_embd).
    w.add_tensor("token_embd.weight", weights(len(tokens), N_EMBD))
    w.add_tensor("token_types.weight", weights(2, N_EMBD))
    w.add_tensor("position_embd.weight", weights(N_CTX, N_EMBD))
    w.add_tensor("token_embd_norm.weight", ones(N_EMBD))
    w.add_tensor("token_embd_norm.bias", zeros(N_EMBD))
    for i in range(N_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", weights(N_EMBD, N_EMBD))
            w.add_tensor(f"blk.{i}.{name}.bias", weights(N_EMBD, scale=0.02))
        w.add_tensor(f"blk.{i}.attn_output_norm.weight", ones(N_EMBD))
        w.add_tensor(f"blk.{i}.attn_output_norm.bias", zeros(N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weights(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.bias", weights(N_FF, scale=0.02))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weights(N_EMBD, N_FF))
        w.add_tensor(f"blk.{i}.ffn_down.bias", weights(N_EMBD, scale=0.02))
        w.add_tensor(f"blk.{i}.layer_output_norm.weight", ones(N_EMBD))
        w.add_tensor(f"blk.{i}.layer_output_norm.bias", zeros(N_EMBD))
    # The classifier head: a dense layer (tanh) on [CLS]'s state, then one score.
    w.add_tensor("cls.weight", weights(N_EMBD, N_EMBD))
    w.add_tensor("cls.bias", weights(N_EMBD, scale=0.02))
    w.add_tensor("cls.output.weight", weights(1, N_EMBD, scale=1.0))
    w.add_tensor("cls.output.bias", zeros(1))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
