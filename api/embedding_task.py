"""One embeddings task, from the API's side: publish ``EmbeddingsRequested``, then gather its
vectors (``EmbeddingsComputed``, on its chunk subject) and its outcome.

As for a generation task (``task_stream.py``): the subscriptions are opened before the task is
published, so nothing is missed; until the first vectors come, the model is checked every
``RECHECK_S`` to still have an embed runner; after a quiet spell the log is asked for the
outcome and the stored vectors (what a subscription misses while NATS reconnects); leaving
without an outcome (the client went away, the wait timed out) publishes ``TaskCancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import nats.errors
import numpy as np
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from api.context import ApiContext
from api.errors import ApiError
from api.serving import task_error
from bus.events import (
    EmbeddingsComputed,
    EmbeddingsRequested,
    TaskCancelled,
    TaskCompleted,
    TaskFailed,
    parse_event,
)
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from bus.subjects import chunk_subject, event_subject
from bus.vectors import Vectors, decode_vectors

RECHECK_S = 2.0

# Why the model cannot serve the task now (None: it can).
Recheck = Callable[[], Awaitable[str | None]]
Outcome = TaskCompleted | TaskFailed

# Cancels being published, kept referenced until done (the event loop holds tasks weakly).
_BACKGROUND: set[asyncio.Task[object]] = set()


class Unavailable(Exception):
    """No runner is left to serve the task; the message says why."""


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
            for subject in (chunk_subject(t.task_id), self._subject("TaskCompleted"),
                            self._subject("TaskFailed")):  # fmt: skip
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

    def _subject(self, kind: str) -> str:
        return event_subject("task", (self.task.model_id, self.task.task_id), kind)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if isinstance(event, EmbeddingsComputed | TaskCompleted | TaskFailed):
            self._queue.put_nowait(event)

    async def _catch_up(self) -> None:
        """Queue the outcome, and the stored vectors, if the log has the outcome."""
        js = self._ctx.nc.jetstream()
        try:
            for kind in ("TaskFailed", "TaskCompleted"):
                try:
                    stored = await js.get_last_msg(EVENTS_STREAM, self._subject(kind))
                except NotFoundError:
                    continue
                outcome = parse_event(stored.data or b"")
                if isinstance(outcome, TaskCompleted):
                    subject = chunk_subject(self.task.task_id)
                    async for msg in read_stream(js, CHUNKS_STREAM, subject):
                        chunk = parse_event(msg.data)
                        if isinstance(chunk, EmbeddingsComputed):
                            self._queue.put_nowait(chunk)
                if isinstance(outcome, TaskCompleted | TaskFailed):
                    self._queue.put_nowait(outcome)
                return
        except (nats.errors.Error, TimeoutError, ValidationError):
            return  # NATS is not back yet: the next quiet spell looks again

    def _cancel(self) -> None:
        """Published from a task of its own: the request's own task may be being cancelled."""
        t = self.task
        cancel = TaskCancelled(task_id=t.task_id, model_id=t.model_id, origin=self._ctx.origin,
                               reason="no longer awaited")  # fmt: skip
        publishing = asyncio.get_running_loop().create_task(self._ctx.publish(cancel))
        _BACKGROUND.add(publishing)
        publishing.add_done_callback(_BACKGROUND.discard)
