"""One rank's part of an MLX model: its layers (rank 0 also the embedding, the last rank the
final norm and the output layer), with their KV cache, as ``mlx_pipeline`` runs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from services.runner.engines.mlx import (
    load_model,
)
from services.runner.engines.mlx_ring import PipelineShard

# Architectures whose forward pass is exactly: embedding, the decoder layers (each with its KV
# cache and the causal mask), final norm, output layer (or the tied embedding). Others (Gemma
# scales its embeddings, mixture-of-experts models route) would need their own stage code.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class Stage:
    """The part of the model one rank holds, and its forward pass."""

    def __init__(
        self,
        layers: list[Module],
        embed: Module | None,
        norm: Module | None,
        head: Module | None,
        *,
        tied: bool,
        hidden_size: int,
        sliding_window: int | None,
        config: dict[str, Any],
    ) -> None:
        self.layers = layers
        self.embed = embed
        self.norm = norm
        self.head = head
        self.hidden_size = hidden_size
        self.vocab_size = int(config["vocab_size"])
        self.config = config
        self._tied = tied
        self._window = sliding_window

    @classmethod
    def load(cls, model_dir: Path, shard: PipelineShard) -> Stage:
        """Only this rank's weights are read: the model is loaded lazily, the other layers are
        dropped before anything is evaluated."""
        model, config = load_model(model_dir)
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} cannot be split by this pipeline (supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        inner: Any = model["model"]
        all_layers: list[Module] = list(inner.layers)
        if len(all_layers) != shard.n_layers:
            raise ValueError(f"the model has {len(all_layers)} layers, not {shard.n_layers}")
        tied = bool(config.get("tie_word_embeddings", False))
        head: Module | None = None
        if shard.last:
            head = inner.embed_tokens if tied else model["lm_head"]
        stage = cls(
            layers=all_layers[shard.start_layer : shard.end_layer],
            embed=inner.embed_tokens if shard.first else None,
            norm=inner.norm if shard.last else None,
            head=head,
            tied=tied,
            hidden_size=int(config["hidden_size"]),
            sliding_window=getattr(inner, "sliding_window", None),
            config=config,
        )
        del model, inner, all_layers
        mx.eval(stage.parameters())
        return stage

    def parameters(self) -> list[Any]:
        modules = [*self.layers, self.embed, self.norm, self.head]
        return [m.parameters() for m in modules if m is not None]  # type: ignore[no-untyped-call]

    def new_cache(self) -> list[Any]:
        return [
            RotatingKVCache(max_size=self._window) if _sliding(layer) else KVCache()  # type: ignore[no-untyped-call]
            for layer in self.layers
        ]

    def hidden(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Token ids (first rank) or the previous rank's hidden states, through this rank's
        layers. The same operations as mlx-lm's model, so the result is bit for bit the one of
        the whole model in one process."""
        h = self.embed(x) if self.embed is not None else x
        masks: dict[bool, Any] = {}
        for layer, c in zip(self.layers, cache, strict=True):
            sliding = _sliding(layer)
            if sliding not in masks:
                window = self._window if sliding else None
                masks[sliding] = create_attention_mask(h, c, window_size=window)
            h = layer(h, masks[sliding], cache=c)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """The last position's logits, shape (1, vocab); last rank only."""
        if self.norm is None or self.head is None:
            raise RuntimeError("only the last rank computes logits")
        out = self.norm(h[:, -1:, :])
        out = self.head.as_linear(out) if self._tied else self.head(out)
        logits: mx.array = out[:, -1, :]
        return logits

    def every_logits(self, h: mx.array) -> mx.array:
        """Every position's logits, shape (tokens, vocab); last rank only."""
        if self.norm is None or self.head is None:
            raise RuntimeError("only the last rank computes logits")
        out = self.norm(h)
        out = self.head.as_linear(out) if self._tied else self.head(out)
        logits: mx.array = out[0]
        return logits


def _sliding(layer: Module) -> bool:
    return bool(getattr(layer, "use_sliding", False))
