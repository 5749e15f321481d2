"""One rank's part of an MLX model: its layers (rank 0 also the embedding, the last rank the
final norm and the output layer), and the KV caches of the sequences in flight, as
a pipeline's ranks run them (``mlx_pipeline``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from inference.engines.mlx.engine import load_model, vocab_size
from inference.engines.mlx.ring import PipelineBroken, PipelineShard
from modelfiles.shard_files import SAFETENSORS_INDEX, mlx_files_for_layers

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
        self.vocab_size = vocab_size(config)
        self.config = config
        self._tied = tied
        self._window = sliding_window

    @classmethod
    def load(cls, model_dir: Path, shard: PipelineShard) -> Stage:
        """Only this rank's weights are read: the model is loaded lazily, the other layers are
        dropped before anything is evaluated. The directory may hold only the safetensors
        files with this rank's tensors (what its node fetched), not the others'."""
        model, config = load_model(model_dir, strict=_all_files_here(model_dir, shard))
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


class StageCaches:
    """One rank's KV caches of the sequences in flight, by slot.

    A sequence's prompt runs with caches of its own (a batch of one, as in one process). Once
    its first token is picked it joins the decoding batch: mlx-lm's batch caches (one row a
    sequence, left-padded to a common length, as ``BatchGenerator`` keeps them), through which
    every decoding step runs all the rows at once. Each rank makes the same changes in the same
    order (the head's commands), so a row is the same sequence on every rank; a step whose rows
    are not this rank's is refused (``PipelineBroken``: the ring is out of step)."""

    def __init__(self, stage: Stage, rank: int) -> None:
        self._stage = stage
        self._rank = rank
        self._prefilling: dict[int, list[Any]] = {}
        self._batch: list[Any] | None = None
        self.rows: list[int] = []  # the decoding batch's slots, in row order

    def start(self, slot: int) -> None:
        if slot in self._prefilling or slot in self.rows:
            raise PipelineBroken(f"rank {self._rank}: slot {slot} started twice")
        self._prefilling[slot] = self._stage.new_cache()

    def prefill(self, slot: int, x: mx.array) -> mx.array:
        """A chunk of the prompt in ``slot``: ``x`` of shape (1, tokens[, hidden])."""
        return self._stage.hidden(x, self._own(slot))

    def join(self, slot: int) -> None:
        """The sequence in ``slot`` has its first token: into the decoding batch."""
        rows = [type(c).merge([c]) for c in self._own(slot)]
        del self._prefilling[slot]
        if self._batch is None:
            self._batch = rows
        else:
            for batch, row in zip(self._batch, rows, strict=True):
                batch.extend(row)
        self.rows.append(slot)

    def drop(self, slot: int) -> None:
        """The sequence in ``slot`` ended (wherever it was): its caches are freed."""
        if self._prefilling.pop(slot, None) is not None or slot not in self.rows:
            return
        i = self.rows.index(slot)
        del self.rows[i]
        if not self.rows:
            self._batch = None
            return
        assert self._batch is not None
        keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
        for c in self._batch:
            c.filter(keep)

    def step(self, slots: list[int], x: mx.array) -> mx.array:
        """A token for every row: ``x`` of shape (rows, 1[, hidden]), in ``slots``' order."""
        if slots != self.rows or self._batch is None:
            raise PipelineBroken(f"rank {self._rank}: a step for slots {slots}, not {self.rows}")
        return self._stage.hidden(x, self._batch)

    def evaluate(self, h: mx.array) -> None:
        """``h`` and every cache it updated."""
        mx.eval(
            h,
            [c.state for c in self._batch or ()],
            [[c.state for c in cache] for cache in self._prefilling.values()],
        )

    def _own(self, slot: int) -> list[Any]:
        cache = self._prefilling.get(slot)
        if cache is None:
            raise PipelineBroken(f"rank {self._rank}: slot {slot} is not being prefilled")
        return cache


def _all_files_here(model_dir: Path, shard: PipelineShard) -> bool:
    """Whether every safetensors file of the model is in ``model_dir`` (then the model loads
    strictly). Raises when one that holds this rank's tensors is missing: a rank loaded
    without its own weights would compute with whatever its layers were made with."""
    index = model_dir / SAFETENSORS_INDEX
    if not index.is_file():
        return True
    weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
    here = {f for f in set(weight_map.values()) if (model_dir / f).is_file()}
    needed = mlx_files_for_layers(weight_map, shard.start_layer, shard.end_layer, shard.n_layers)
    if needed - here:
        missing = ", ".join(sorted(needed - here))
        raise FileNotFoundError(f"{model_dir}: rank {shard.rank} needs {missing}")
    return here == set(weight_map.values())
