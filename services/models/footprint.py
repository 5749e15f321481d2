"""How much memory a model takes to serve, from the facts ``ModelAdded`` carries.

Placement runs on these numbers only, so it needs no model file: the weights (the file size,
and its projector's for a model that reads images),
the KV cache (bytes per token of context, times the context, times the slots: each task served
at once has a context of its own; scaled by its type, ``kv_bytes_per_token``), and the
engine's working memory (compute buffers, logits, tokenizer tables), which every runner pays
once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from events.kinds import DEFAULT_KV_CACHE, InstanceRole, KvCacheType
from events.units import MiB
from projectors.rows import ModelRow
from services.models.projector import projector_bytes

# Memory llama.cpp takes beyond the weights and the KV cache: compute buffers, the logits row,
# the tokenizer's tables. Measured with llama-cpp-python 0.3 on CPU (RSS after loading and
# one generation, minus weights and KV cache): 23 MiB for SmolLM2-135M (49,152 tokens) and
# 61 MiB for Gemma 3 270M (262,144 tokens), the same at n_ctx 2048 and 8192 (flash attention
# is on by default, so no n_ctx x n_ctx scores buffer). The allowance below covers both with
# room to spare: a fixed part plus a part that grows with the vocabulary.
OVERHEAD_FIXED_BYTES = 48 * MiB
OVERHEAD_PER_VOCAB_BYTES = 256


def engine_overhead_bytes(vocab_size: int) -> int:
    """The engine's working memory for a model with ``vocab_size`` tokens, per runner."""
    return OVERHEAD_FIXED_BYTES + OVERHEAD_PER_VOCAB_BYTES * vocab_size


# The context a runner gets when the request names none (capped at the model's own).
DEFAULT_CONTEXT_LENGTH = 2048
# An embed or rerank instance's: the longest input (or query and document) it takes, and what
# one batch of inputs holds. Small, so that such an instance needs little beyond its weights.
DEFAULT_EMBED_CONTEXT_LENGTH = 512
# Slots (tasks a runner serves at once): when the request names none, placement gives as many
# as fit beside the weights, up to this; a request may ask for up to MAX_SLOTS.
DEFAULT_MAX_SLOTS = 8
MAX_SLOTS = 64


def context_for(model_context: int, requested: int | None, role: InstanceRole = "chat") -> int:
    """The context an instance is served with: what was asked for, else the default (of its
    role), never more than the model was trained for (when that is known)."""
    if requested is not None:
        return requested
    default = DEFAULT_CONTEXT_LENGTH if role == "chat" else DEFAULT_EMBED_CONTEXT_LENGTH
    return min(default, model_context) if model_context else default


# Bytes of a block of 32 KV-cache elements in each type, as ggml stores them: f16 2 bytes an
# element; q8_0 32 one-byte values and an f16 scale; q4_0 32 four-bit values and an f16 scale.
KV_BLOCK_BYTES: dict[KvCacheType, int] = {"f16": 64, "q8_0": 34, "q4_0": 18}
KV_BLOCK = 32


def kv_bytes_per_token(f16_bytes: int, kv_cache: KvCacheType) -> int:
    """The KV cache per token of a cache of ``kv_cache`` type, from its f16 size (what
    ``ModelAdded`` carries), rounded up: a half (17/32) for q8_0, a quarter (9/32) for q4_0."""
    return -(-f16_bytes * KV_BLOCK_BYTES[kv_cache] // (2 * KV_BLOCK))


@dataclass(frozen=True, slots=True)
class Footprint:
    n_layers: int
    weights_bytes: int
    kv_bytes_per_token: int  # of a cache of type kv_cache
    overhead_bytes: int
    kv_cache: KvCacheType = DEFAULT_KV_CACHE

    @classmethod
    def of(cls, model: ModelRow) -> Footprint:
        return cls(
            n_layers=model.n_layers,
            weights_bytes=model.size_bytes + projector_bytes(model),
            kv_bytes_per_token=model.kv_bytes_per_token,
            overhead_bytes=model.overhead_bytes,
        )

    def with_kv_cache(self, kv_cache: KvCacheType) -> Footprint:
        """The footprint of the model served with a KV cache of ``kv_cache`` type."""
        if self.kv_cache != DEFAULT_KV_CACHE:
            raise ValueError(f"a footprint with a {self.kv_cache} KV cache is converted already")
        per_token = kv_bytes_per_token(self.kv_bytes_per_token, kv_cache)
        return replace(self, kv_bytes_per_token=per_token, kv_cache=kv_cache)

    def need_bytes(self, n_ctx: int, layers: int | None = None, slots: int = 1) -> int:
        """Memory for ``layers`` of the model (all by default) at ``n_ctx`` tokens for each of
        ``slots`` tasks at once. Weights and KV cache are taken in proportion to the layers:
        the embeddings and output head are not per layer, but they are small next to the
        blocks of any model worth splitting."""
        share = self.weights_bytes + self.kv_bytes_per_token * n_ctx * slots
        if layers is not None and layers != self.n_layers:
            share = -(-share * layers // self.n_layers)  # round up: never promise too little
        return share + self.overhead_bytes
