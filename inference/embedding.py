"""What an embeddings task asks of the engine, and its answer as events: the inputs as token
lists (checked), the vectors cut to the dimensions asked for, and the slices of vectors that
``EmbeddingsComputed`` events carry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Protocol

import numpy as np

from events.catalogue import EmbeddingsComputed, EmbeddingsRequested
from events.vectors import Vectors, encode_vectors, rows_per_message
from structured.reply import InvalidRequest


class Embedder(Protocol):
    """What an embed runner needs from its engine."""

    @property
    def n_ctx(self) -> int:
        """The longest input, in tokens."""
        ...

    @property
    def n_embd(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    def text_tokens(self, text: str) -> list[int]: ...

    def embed(self, inputs: Sequence[Sequence[int]]) -> Vectors:
        """One L2-normalised row per input; ``InvalidRequest`` for an input it cannot take."""
        ...


def embedding_inputs(engine: Embedder, task: EmbeddingsRequested) -> list[list[int]]:
    """The task's inputs as token lists (cut to the context if the task says so);
    ``InvalidRequest`` for a task the engine cannot serve as asked (no input, a token outside
    the vocabulary, too many dimensions)."""
    if task.dimensions is not None and task.dimensions > engine.n_embd:
        raise InvalidRequest(
            f"dimensions is {task.dimensions}, more than the model's {engine.n_embd}"
        )
    if task.token_ids is not None:
        inputs = [list(tokens) for tokens in task.token_ids]
        for i, tokens in enumerate(inputs):
            outside = [t for t in tokens if not 0 <= t < engine.n_vocab]
            if outside:
                raise InvalidRequest(
                    f"input {i} has token {outside[0]}, outside the model's"
                    f" vocabulary of {engine.n_vocab} tokens"
                )
    else:
        inputs = [engine.text_tokens(text) for text in task.texts or []]
    if not inputs:
        raise InvalidRequest("the request has no input")
    if task.truncate:
        inputs = [tokens[: engine.n_ctx] for tokens in inputs]
    return inputs


def cut(vectors: Vectors, dimensions: int | None) -> Vectors:
    """The first ``dimensions`` of each (normalised) vector, normalised again: what a
    Matryoshka-trained model's shorter embeddings are. Any model's vectors can be cut so; only
    such models keep their quality when they are."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    kept = vectors[:, :dimensions]
    norms = np.linalg.norm(kept, axis=1, keepdims=True)
    out: Vectors = (kept / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return out


def computed_events(
    task: EmbeddingsRequested, vectors: Vectors, origin: str, ts: float
) -> Iterator[EmbeddingsComputed]:
    """The vectors as events, as many per event as stay far below a NATS message's size."""
    at = datetime.fromtimestamp(ts, UTC)
    total, dimensions = vectors.shape
    step = rows_per_message(dimensions)
    for start in range(0, total, step):
        yield EmbeddingsComputed(
            task_id=task.task_id,
            origin=origin,
            ts=at,
            start=start,
            total=total,
            dimensions=dimensions,
            vectors=encode_vectors(vectors[start : start + step]),
        )
