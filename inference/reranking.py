"""What a rerank task (``EmbeddingsRequested`` with a ``query``) asks of the engine: each
document paired with the query as one sequence (checked), and its answer, one score per
document, which ``EmbeddingsComputed`` events carry as one-float rows (``embedding.py``'s
``computed_events``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from events.catalogue import EmbeddingsRequested
from events.vectors import Vectors
from structured.reply import InvalidRequest


class Reranker(Protocol):
    """What a rerank runner needs from its engine."""

    @property
    def n_ctx(self) -> int:
        """The longest sequence (query and document), in tokens."""
        ...

    def pair_tokens(self, query: str, document: str) -> list[int]: ...

    def score(self, pairs: Sequence[Sequence[int]]) -> Vectors:
        """One row of one score per pair; ``InvalidRequest`` for a pair it cannot take."""
        ...


def rerank_inputs(engine: Reranker, task: EmbeddingsRequested) -> list[list[int]]:
    """The task's query and documents as one token sequence per document (its end cut to the
    context if the task says so); ``InvalidRequest`` for a task without documents or query,
    or a document too long with the query."""
    query = task.query
    if query is None:
        raise InvalidRequest("a rerank task needs a query")
    if task.token_ids is not None or not task.texts:
        raise InvalidRequest("a rerank task needs documents, as texts")
    pairs = [engine.pair_tokens(query, document) for document in task.texts]
    if task.truncate:
        return [tokens[: engine.n_ctx] for tokens in pairs]
    for i, tokens in enumerate(pairs):
        if len(tokens) > engine.n_ctx:
            raise InvalidRequest(
                f"document {i} with the query is {len(tokens)} tokens, more than the"
                f" {engine.n_ctx} this rerank instance takes (request one with a larger"
                " context_length)"
            )
    return pairs


def scores_of(engine: Reranker, task: EmbeddingsRequested) -> tuple[int, Vectors]:
    """(the tokens read, the scores): on the engine's thread."""
    pairs = rerank_inputs(engine, task)
    return sum(map(len, pairs)), engine.score(pairs)
