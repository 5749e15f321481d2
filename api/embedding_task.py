"""One embeddings (or rerank) task, from the API's side: publish ``EmbeddingsRequested``, then
gather its vectors (``EmbeddingsComputed``, on its chunk subject; a rerank task's scores, one
float a row) and its outcome.

As for a generation task (``task_stream.py``): the subscriptions are opened before the task is
published, so nothing is missed; until the first vectors come, the model is checked every
``RECHECK_S`` to still have an embed runner; after a quiet spell the log is asked for the
outcome and the stored vectors (what a subscription misses while NATS reconnects); leaving
without an outcome (the client went away, the wait timed out) publishes ``TaskCancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import numpy as np
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from api.context import ApiContext
from api.errors import ApiError
from api.serving import (
    gate,
    log_unavailable,
    owned,
    recheck,
    request_lost,
    task_error,
    unavailable,
    used,
)
from api.task_stream import (
    RECHECK_S,
    Recheck,
    outcome_subject,
    publish_in_background,
    request_gone,
    stored_outcome,
)
from events.catalogue import (
    EmbeddingsComputed,
    EmbeddingsRequested,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    parse_event,
)
from events.vectors import Vectors, decode_vectors

Outcome = TaskCompleted | TaskFailed


class Unavailable(Exception):
    """No runner is left to serve the task; the message says why."""


class RequestLost(Exception):
    """The log lost the task's request after acknowledging it (a power cut)."""


async def gated(ctx: ApiContext, task: EmbeddingsRequested) -> tuple[Vectors, TaskCompleted]:
    """``computed``, once through the gate every inference request passes (``serving.gate``:
    the key's limits, the model serving, a slot): owned by the request's key, its tokens
    counted for it."""
    task = owned(task)
    permit = await gate(ctx, task.model_id, role=task.role, keep_alive_s=task.keep_alive_s)
    try:
        vectors, done = await computed(ctx, task)
        permit.task_done()
    finally:
        permit.close()
    used(ctx, done.usage.total_tokens)
    return vectors, done


async def computed(ctx: ApiContext, task: EmbeddingsRequested) -> tuple[Vectors, TaskCompleted]:
    """The task's rows (one per input, in order) and its completion, once its model serves in
    the task's role (``require_serving``, asked by the caller); ``ApiError`` otherwise: the
    task's failure, a 503 when no runner is left (or the log cannot be reached), a 504 when it
    takes longer than the API waits."""
    try:
        return await EmbeddingTask(ctx, task, recheck(ctx, task.model_id, task.role)).run()
    except nats.errors.Error as exc:
        raise log_unavailable(exc) from exc
    except Unavailable as exc:
        raise unavailable(str(exc)) from None
    except RequestLost:
        raise request_lost() from None
    except TimeoutError:
        raise ApiError(504, "the task took longer than the API waits") from None


class EmbeddingTask:
    def __init__(self, ctx: ApiContext, task: EmbeddingsRequested, recheck: Recheck) -> None:
        self._ctx = ctx
        self.task = task
        self._recheck = recheck
        self._queue: asyncio.Queue[EmbeddingsComputed | Outcome] = asyncio.Queue()
        self._slices: dict[int, EmbeddingsComputed] = {}
        self._outcome: Outcome | None = None

    async def run(self) -> tuple[Vectors, TaskCompleted]:
        """The vectors (one row per input, in order) and the completion; raises ``ApiError``
        for a failed task (``TaskFailed``: its error), ``Unavailable``, or ``TimeoutError``."""
        nc, t = self._ctx.nc, self.task
        subs: list[Subscription] = []
        published = False
        try:
            chunks = EmbeddingsComputed.subject_for(t.task_id)
            outcomes = (outcome_subject(t, TaskCompleted), outcome_subject(t, TaskFailed))
            for subject in (chunks, *outcomes):
                subs.append(await nc.subscribe(subject, cb=self._on_msg))
            await self._ctx.publish(t)
            published = True
            async with asyncio.timeout(self._ctx.config.task_timeout_s):
                return await self._gather()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            if published and self._outcome is None:
                self._cancel()

    async def _gather(self) -> tuple[Vectors, TaskCompleted]:
        while True:
            try:
                async with asyncio.timeout(RECHECK_S):
                    self._take(await self._queue.get())
            except TimeoutError:
                if not self._slices and (why := await self._recheck()) is not None:
                    raise Unavailable(why) from None
                await self._catch_up()
            while not self._queue.empty():
                self._take(self._queue.get_nowait())
            outcome = self._outcome
            if isinstance(outcome, TaskFailed):
                raise task_error(outcome.error)
            vectors = self._vectors()
            if isinstance(outcome, TaskCompleted) and vectors is not None:
                return vectors, outcome

    def _take(self, event: EmbeddingsComputed | Outcome) -> None:
        if isinstance(event, EmbeddingsComputed):
            self._slices[event.start] = event
        elif self._outcome is None:
            self._outcome = event

    def _vectors(self) -> Vectors | None:
        """Every input's vector, once all slices came; None before."""
        slices = [self._slices[k] for k in sorted(self._slices)]
        if not slices:
            return None
        try:
            parts = [decode_vectors(s.vectors, s.dimensions) for s in slices]
        except ValueError as exc:
            raise ApiError(500, f"the runner sent malformed vectors: {exc}") from exc
        if sum(len(p) for p in parts) != slices[0].total:
            return None
        return np.concatenate(parts)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if isinstance(event, EmbeddingsComputed | TaskCompleted | TaskFailed):
            self._queue.put_nowait(event)

    async def _catch_up(self) -> None:
        """Queue the outcome, and the stored vectors, if the log has the outcome."""
        outcome, stored = await stored_outcome(self._ctx.nc, self.task)
        if outcome is None and await request_gone(self._ctx.nc, self.task):
            raise RequestLost()
        for chunk in stored:
            if isinstance(chunk, EmbeddingsComputed):
                self._queue.put_nowait(chunk)
        if outcome is not None:
            self._queue.put_nowait(outcome)

    def _cancel(self) -> None:
        """Published from a task of its own: the request's own task may be being cancelled."""
        t = self.task
        cancel = TaskCancelled(
            task_id=t.task_id,
            model_id=t.model_id,
            origin=self._ctx.origin,
            reason="no longer awaited",
        )
        publish_in_background(self._ctx.publish, cancel)
