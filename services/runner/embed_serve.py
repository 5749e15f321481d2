"""Serving embeddings: an embed instance's runners pull ``EmbeddingsRequested`` from their
model's own consumer (``embeddings-<model>``), compute all its inputs together, and publish
the vectors (``EmbeddingsComputed`` on the task's chunk subject), then ``TaskCompleted`` with
the prompt tokens, or ``TaskFailed``. A rerank instance's runners are the same server
(``RerankServer``) with a reranker engine: they pull the tasks with a ``query`` from a consumer
of their own (``rerank-<model>``), and publish one score per document in place of vectors.

Everything but the work is ``TaskPuller``'s, as for chat runners: one request at a time, acked
when started, a redelivered one that was taken already not served twice, the task noted for
the worker in case the runner dies."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from pathlib import Path
from typing import ClassVar

from nats.aio.client import Client

from events.catalogue import EmbeddingsRequested, TaskCancelled, TaskCompleted, TaskStarted
from events.kinds import InstanceRole
from events.records import Timings, Usage
from events.vectors import Vectors
from inference.embedding import Embedder, computed_events, cut, embedding_inputs
from inference.engines.base import EngineBroken
from inference.reranking import Reranker, scores_of
from services.runner.claim import Claim
from services.runner.consumers import Pulled, embeddings_consumer_name, rerank_consumer_name
from services.runner.serve import TaskPuller
from services.runner.state_reporter import RunnerIdentity
from structured.reply import InvalidRequest

log = logging.getLogger(__name__)


class _PoolingServer(TaskPuller):
    """What embed and rerank runners share: all but the computing."""

    role: ClassVar[InstanceRole]

    async def serve_pulled(self, task: Pulled, claim: Claim) -> bool:
        # The other role's tasks come through this consumer too (one type, one filter): left.
        if not isinstance(task, EmbeddingsRequested) or task.role != self.role:
            return False
        # Cancelled while it waited (its client went away): the vectors are for no one. (A
        # request is computed whole, so one cancelled once it started is computed anyway.)
        if await self._logged(task, TaskCancelled):
            log.info("embeddings task %s was cancelled before it started", task.task_id)
            return False
        await self.serve(task, claim)
        return True

    async def serve(self, task: EmbeddingsRequested, claim: Claim) -> None:
        received = time.perf_counter()
        me = self._me
        started = TaskStarted(
            task_id=task.task_id,
            model_id=task.model_id,
            origin=me.node_id,
            runner_id=me.runner_id,
            instance_id=me.instance_id,
        )
        loop = asyncio.get_running_loop()
        try:
            # Announced once computed, not meanwhile: the publishing's CPU (here, in the
            # nats-server, in the log's consumers) would be taken from llama.cpp's threads.
            computing = loop.run_in_executor(self._engine_thread, self._compute, task)
            try:
                tokens, vectors = await computing
            finally:
                await asyncio.gather(self._events.publish(started), self.report_running())
                await claim.done()
            for event in computed_events(task, vectors, me.node_id, time.time()):
                await self._chunks.publish(event)
            await self._chunks.flush()
            total_ms = (time.perf_counter() - received) * 1000
            await self._events.publish(
                TaskCompleted(
                    task_id=task.task_id,
                    model_id=task.model_id,
                    origin=me.node_id,
                    runner_id=me.runner_id,
                    finish_reason="stop",
                    usage=Usage(prompt_tokens=tokens, completion_tokens=0),
                    # Nothing is generated: the answer comes whole, at its first "token".
                    timings=Timings(ttft_ms=total_ms, tokens_per_s=0.0, total_ms=total_ms),
                ),
                msg_id=f"done:{task.task_id}",
            )
        except InvalidRequest as exc:
            await self._fail(task, f"invalid request: {exc}")
        except Exception as exc:  # an engine error fails this task, not the runner...
            log.exception("%s task %s failed", self.role, task.task_id)
            await self._fail(task, f"engine error: {exc}")
            if isinstance(exc, EngineBroken):  # ...unless the engine cannot go on
                raise

    @abstractmethod
    def _compute(self, task: EmbeddingsRequested) -> tuple[int, Vectors]:
        """(prompt tokens, one row per input): on the engine's thread."""


class EmbeddingServer(_PoolingServer):
    role: ClassVar[InstanceRole] = "embed"

    def __init__(
        self, nc: Client, embedder: Embedder, me: RunnerIdentity, task_file: Path | None = None
    ) -> None:
        super().__init__(nc, me, task_file)
        self._embedder = embedder

    def consumer_names(self) -> tuple[str, str]:
        model = self._me.model_id
        return embeddings_consumer_name(model), EmbeddingsRequested.filter_for(model)

    def _compute(self, task: EmbeddingsRequested) -> tuple[int, Vectors]:
        inputs = embedding_inputs(self._embedder, task)
        return sum(map(len, inputs)), cut(self._embedder.embed(inputs), task.dimensions)


class RerankServer(_PoolingServer):
    """A rerank instance's: the tasks with a query, scored by a reranker."""

    role: ClassVar[InstanceRole] = "rerank"

    def __init__(
        self, nc: Client, reranker: Reranker, me: RunnerIdentity, task_file: Path | None = None
    ) -> None:
        super().__init__(nc, me, task_file)
        self._reranker = reranker

    def consumer_names(self) -> tuple[str, str]:
        model = self._me.model_id
        return rerank_consumer_name(model), EmbeddingsRequested.filter_for(model)

    def _compute(self, task: EmbeddingsRequested) -> tuple[int, Vectors]:
        return scores_of(self._reranker, task)
