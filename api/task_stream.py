"""One task, from the API's side: publish ``TaskCreated``, then follow its chunks and outcome.

Chunks and task events are followed on plain NATS subscriptions (JetStream delivers stored
messages to them as well), opened before the task is published so that nothing is missed.
What a subscription cannot get is what was published while this process was reconnecting to
NATS (a server restart, a network blip): after a quiet spell the stream looks the task's
outcome up in the log, and takes its stored chunks from there. The stream ends with the last
chunk (the one with a finish reason) together with ``TaskCompleted``, or with ``TaskFailed``.
Leaving early (a client that went away) publishes ``TaskCancelled``, and the runner stops
within a token.

A task continued after its runner was thought lost has several attempts (``events/attempts.py``):
the stream follows the task's ``TaskCreated`` subject too, and takes only the chunks and the
outcome that count for the newest attempt it knows of, so that a runner that was only stalled,
and wakes up, cannot mix its sampling into the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from bus.leaderless import RETRY_FOR_S
from bus.publisher import Publisher
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from events.attempts import Attempt, attempt_of, better, counts, newest, outcome_counts, seen_in
from events.catalogue import (
    ChunkGenerated,
    EmbeddingsRequested,
    EventBase,
    PromptScored,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    parse_event,
)
from events.records import TokenLogprob

# Tasks publishing cancels, kept referenced until done (the event loop holds them weakly).
_BACKGROUND: set[asyncio.Task[object]] = set()


# While a task's chunks do not come (none yet, or its runner was lost), its model is checked
# this often to still have a runner to serve it, or one coming back: the last one may stop
# (its instance rejected, deleted) after the request was accepted.
# And after this long without news, the log is asked for the task's outcome (see above).
RECHECK_S = 2.0

# Why a task is given up whose TaskCreated the log lost after acknowledging it.
LOST = (
    "the event log lost this request after accepting it (its nats-server lost writes it had"
    " not synced to disk: a power cut or crash); send it again"
)

# Why a model cannot serve now (None: it can).
Recheck = Callable[[], Awaitable[str | None]]
# Told of each event the stream published (for the API's metrics).
Published = Callable[[EventBase], None]
# Told once when the API stops following the task, however that is (admission's slot frees).
Closed = Callable[[], None]
# What the stream follows of its task: chunks, the outcome, continuations.
Followed = ChunkGenerated | TaskCompleted | TaskFailed | TaskCreated


@dataclass(frozen=True)
class Finished:
    """How the task ended: ``completed`` (with usage), ``failed`` (with the error), or given up
    because no runner is left to serve it (``unavailable``, saying why), or because the log
    lost its ``TaskCreated`` (``lost``: a power cut took the nats-server's unsynced writes)."""

    completed: TaskCompleted | None = None
    failed: TaskFailed | None = None
    unavailable: str | None = None
    lost: str | None = None

    @property
    def given_up(self) -> str | None:
        """Why the API stopped waiting without an outcome, if it did."""
        return self.unavailable or self.lost


def outcome_subject(
    task: TaskCreated | EmbeddingsRequested, kind: type[TaskCompleted | TaskFailed]
) -> str:
    """The subject of a task's ``TaskCompleted`` or ``TaskFailed``."""
    return kind.subject_for(task.model_id, task.task_id)


async def stored_outcome(
    nc: Client, task: TaskCreated | EmbeddingsRequested
) -> tuple[TaskCompleted | TaskFailed | None, list[EventBase]]:
    """The task's outcome if the log has it, and then (completed) its stored chunk-stream
    events: what subscriptions miss while this process reconnects to NATS. Once the outcome
    is stored so is every chunk (a runner flushes its chunks first). (None, []) when the log
    has no outcome, or cannot be read now (NATS is not back yet: ask again later)."""
    js = nc.jetstream()
    try:
        for kind in (TaskFailed, TaskCompleted):
            try:
                stored = await js.get_last_msg(EVENTS_STREAM, outcome_subject(task, kind))
            except NotFoundError:
                continue
            outcome = parse_event(stored.data or b"")
            if not isinstance(outcome, TaskCompleted | TaskFailed):
                return None, []
            chunks: list[EventBase] = []
            if isinstance(outcome, TaskCompleted):
                subject = ChunkGenerated.subject_for(task.task_id)
                chunks = [
                    parse_event(m.data) async for m in read_stream(js, CHUNKS_STREAM, subject)
                ]
            return outcome, chunks
    except (nats.errors.Error, TimeoutError, ValidationError):
        pass
    return None, []


async def request_gone(nc: Client, task: TaskCreated | EmbeddingsRequested) -> bool:
    """Whether the log says it has no request event of this task: it was stored (its publish
    was acknowledged), so the log lost it. False when the log cannot be read now."""
    try:
        await nc.jetstream().get_last_msg(EVENTS_STREAM, task.subject)
    except NotFoundError:
        return True
    except (nats.errors.Error, TimeoutError):
        pass
    return False


def publish_in_background(
    publish: Callable[[EventBase], Coroutine[Any, Any, None]], event: EventBase
) -> None:
    """Publish ``event`` from a task of its own (a cancel): the request's own task is being
    cancelled, and the server (anyio) cancels every await it makes from here on."""
    publishing = asyncio.get_running_loop().create_task(publish(event))
    _BACKGROUND.add(publishing)
    publishing.add_done_callback(_BACKGROUND.discard)


class TaskStream:
    def __init__(
        self,
        nc: Client,
        task: TaskCreated,
        origin: str,
        timeout_s: float,
        recheck: Recheck | None = None,
        on_published: Published | None = None,
        on_closed: Closed | None = None,
        log_wait_s: float = RETRY_FOR_S,
    ) -> None:
        self._nc = nc
        self._log_wait_s = log_wait_s
        self._recheck = recheck
        self._on_published = on_published
        self._on_closed = on_closed
        self.task = task
        self._origin = origin
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[Followed] = asyncio.Queue()
        self._subs: list[Subscription] = []
        self.finished: Finished | None = None
        # A task with echo: its prompt's scores, by the position of each slice's first token.
        self._prompt_slices: dict[int, PromptScored] = {}
        # time.monotonic() at the start and at the first and last chunk, for the metrics.
        self.started_at: float | None = None
        self.first_chunk_at: float | None = None
        self.last_chunk_at: float | None = None

    async def __aenter__(self) -> TaskStream:
        self.started_at = time.monotonic()
        t = self.task
        self._subs = [
            await self._nc.subscribe(ChunkGenerated.subject_for(t.task_id), cb=self._on_msg),
            await self._nc.subscribe(outcome_subject(t, TaskCompleted), cb=self._on_msg),
            await self._nc.subscribe(outcome_subject(t, TaskFailed), cb=self._on_msg),
            # Its continuations: which attempt's chunks count.
            await self._nc.subscribe(t.subject, cb=self._on_msg),
        ]
        try:
            await self._publish(t)
        except BaseException:  # not stored: nothing to follow
            self._closed()
            await self._unsubscribe()
            raise
        return self

    def _closed(self) -> None:
        if self._on_closed is not None:
            told, self._on_closed = self._on_closed, None
            told()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closed()
        await self._unsubscribe()
        if self.finished is None or self.finished.given_up is not None:
            # The client went away (or the wait timed out): stop the runner's work.
            reason = "the client went away" if kind is not None else "no longer awaited"
            if self.finished is not None and self.finished.given_up is not None:
                reason = self.finished.given_up
            cancel = TaskCancelled(
                task_id=self.task.task_id,
                model_id=self.task.model_id,
                origin=self._origin,
                reason=reason,
            )
            publish_in_background(self._publish, cancel)

    async def _unsubscribe(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    async def _publish(self, event: EventBase) -> None:
        await Publisher(self._nc.jetstream(), retry_for=self._log_wait_s).publish(event)
        if self._on_published is not None:
            self._on_published(event)

    async def _catch_up(self, next_idx: int) -> bool:
        """Queue the task's outcome and its chunks from ``next_idx`` on, if the log has the
        outcome (``stored_outcome``). False when the log no longer has the task at all."""
        outcome, stored = await stored_outcome(self._nc, self.task)
        if outcome is None and await request_gone(self._nc, self.task):
            return False
        if outcome is not None and (created := await self._last_created()) is not None:
            self._queue.put_nowait(created)  # the newest attempt, before its chunks
        for chunk in stored:
            if isinstance(chunk, ChunkGenerated) and chunk.idx >= next_idx:
                self._queue.put_nowait(chunk)
            elif isinstance(chunk, PromptScored):
                self._prompt_slices[chunk.start] = chunk
        if outcome is not None:
            self._queue.put_nowait(outcome)
        return True

    async def _last_created(self) -> TaskCreated | None:
        """The task's last ``TaskCreated`` in the log (its newest attempt); None if it cannot
        be read now."""
        try:
            stored = await self._nc.jetstream().get_last_msg(EVENTS_STREAM, self.task.subject)
            created = parse_event(stored.data or b"")
        except (nats.errors.Error, TimeoutError, ValidationError):
            return None
        return created if isinstance(created, TaskCreated) else None

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if isinstance(event, ChunkGenerated | TaskCompleted | TaskFailed | TaskCreated):
            self._queue.put_nowait(event)
        elif isinstance(event, PromptScored):
            # Published before the first chunk, on the same subject: here before it.
            self._prompt_slices[event.start] = event

    @property
    def prompt_scores(self) -> list[TokenLogprob] | None:
        """The prompt's tokens with their scores (a task with echo), once all arrived."""
        slices = [self._prompt_slices[k] for k in sorted(self._prompt_slices)]
        tokens = [t for s in slices for t in s.tokens]
        if not slices or len(tokens) != slices[0].total:
            return None
        return tokens

    async def chunks(self) -> AsyncIterator[ChunkGenerated]:
        """The task's chunks in order; afterwards ``finished`` says how it ended."""
        async for group in self.chunk_groups():
            for chunk in group:
                yield chunk

    async def chunk_groups(self) -> AsyncIterator[list[ChunkGenerated]]:
        """The task's chunks in order, in groups: each time, all that have arrived (a runner
        sends them in groups, and the API answers each group with one write)."""
        next_idx = 0
        early: dict[int, ChunkGenerated] = {}
        last_seen = False
        completed: TaskCompleted | None = None
        latest: Attempt | None = attempt_of(self.task)  # the newest attempt known
        async with asyncio.timeout(self._timeout_s):
            while True:
                try:
                    async with asyncio.timeout(RECHECK_S):
                        events = [await self._queue.get()]
                except TimeoutError:
                    recheck = self._recheck
                    if recheck is not None and (why := await recheck()) is not None:
                        self.finished = Finished(unavailable=why)
                        return
                    if not await self._catch_up(next_idx):
                        self.finished = Finished(lost=LOST)
                        return
                    continue
                while not self._queue.empty():
                    events.append(self._queue.get_nowait())
                group: list[ChunkGenerated] = []
                failed: TaskFailed | None = None
                for event in events:
                    if isinstance(event, TaskCreated | ChunkGenerated):
                        was = latest
                        if isinstance(event, TaskCreated):
                            latest = newest(latest, attempt_of(event))
                        else:
                            latest = newest(latest, seen_in(event))
                        if latest != was:  # what older attempts left waiting may not count
                            early = {i: c for i, c in early.items() if counts(c, latest)}
                    if isinstance(event, TaskCreated):
                        continue
                    if isinstance(event, TaskFailed | TaskCompleted):
                        if not outcome_counts(event, latest):
                            continue  # an older attempt's: the task goes on
                        if isinstance(event, TaskFailed):
                            failed = failed or event
                        else:
                            completed = event
                        continue
                    if event.idx < next_idx or not counts(event, latest):
                        continue
                    if better(event, early.get(event.idx)):
                        early[event.idx] = event
                    while next_idx in early:
                        chunk = early.pop(next_idx)
                        next_idx += 1
                        last_seen = last_seen or chunk.finish_reason is not None
                        group.append(chunk)
                if group:
                    self.last_chunk_at = time.monotonic()
                    if self.first_chunk_at is None:
                        self.first_chunk_at = self.last_chunk_at
                    yield group
                if failed is not None:
                    self.finished = Finished(failed=failed)
                    return
                if last_seen and completed is not None:
                    self.finished = Finished(completed=completed)
                    return
