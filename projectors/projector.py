"""The live projector: folds SHOAL_EVENTS into the projection database.

Each fetched batch is applied in ONE transaction together with the tracking row
``(projector, stream, last_seq)``; messages are acked only after the commit. The database, not
the consumer, is the source of truth for where the projector stands: at every start the durable
consumer is re-created at ``last_seq + 1``, so a crash, a redelivery or a database restored from
a backup never applies an event twice or skips one.

The projector keeps the projection in memory too (it is the only writer, so memory and database
cannot drift) and runs the pure rules against it; only the net row changes of a batch are
written. Run exactly one projector per database.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Sequence

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.consumer import Delivered, EventConsumer
from bus.streams import EVENTS_STREAM, StreamSettings, ensure_streams
from bus.subjects import EVENTS_PREFIX
from projectors import database
from projectors.rules import changes_for
from projectors.state import Change, ClusterState
from projectors.store import load_state, read_offset, write_changes, write_offset

log = logging.getLogger(__name__)

DEFAULT_NAME = "main"


def tune_gc() -> None:
    """Collect garbage less often in a process that folds events.

    Parsing and folding allocate many short-lived objects, and with Python's default thresholds
    the collector took 25-30% of a catch-up (bench/projector.py). Freezing what start-up
    allocated and raising the young-generation threshold keeps pauses at a few milliseconds.
    Called by the processes that run a projector or a replay, not on import.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def fold_batch(
    state: ClusterState, batch: Sequence[Delivered], after_seq: int
) -> tuple[list[Change], list[tuple[Delivered, Exception]]]:
    """Apply a batch to ``state`` (skipping sequences ``<= after_seq``, i.e. redeliveries).
    Returns the changes to write and the events whose rule raised (to be dead-lettered)."""
    changes: list[Change] = []
    failed: list[tuple[Delivered, Exception]] = []
    for d in batch:
        if d.stream_seq <= after_seq:
            continue
        try:
            ch = changes_for(state, d.event)
        except Exception as exc:  # a rule bug on one event must not stop the projection
            failed.append((d, exc))
            continue
        state.commit(ch)
        changes.extend(ch)
    return changes, failed


class Projector:
    def __init__(
        self,
        js: JetStreamContext,
        engine: AsyncEngine,
        name: str = DEFAULT_NAME,
        batch_size: int = 2000,
        stream_settings: StreamSettings | None = None,
    ) -> None:
        self._js = js
        self._engine = engine
        self.name = name
        self.batch_size = batch_size
        self._stream_settings = stream_settings
        self.applied_seq = 0
        self.state = ClusterState()
        self.consumer: EventConsumer | None = None
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Project until ``stop`` is set (or forever). Database errors are retried with backoff
        from the last committed state."""
        stop = stop or asyncio.Event()
        await ensure_streams(self._js, self._stream_settings)
        await database.upgrade(self._engine)
        backoff = 0.5
        while not stop.is_set():
            try:
                await self._project(stop)
            except (SQLAlchemyError, nats.errors.Error) as exc:
                log.error("projector error, resuming from the last commit: %s", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
        if self.consumer is not None:
            await self.consumer.stop()

    async def _project(self, stop: asyncio.Event) -> None:
        async with self._engine.connect() as conn:
            self.state = await load_state(conn)
            self.applied_seq = await read_offset(conn, self.name, EVENTS_STREAM)
        if self.consumer is not None:
            await self.consumer.stop()
        self.consumer = EventConsumer(
            self._js,
            EVENTS_STREAM,
            durable=f"projector-{self.name}",
            filter_subject=f"{EVENTS_PREFIX}.>",
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.applied_seq + 1,
            max_ack_pending=self.batch_size * 2,
        )
        await self.consumer.start(recreate=True)
        log.info("projector %s resuming after seq %d", self.name, self.applied_seq)
        self.ready.set()
        while not stop.is_set():
            batch = await self.consumer.fetch(self.batch_size, timeout=0.5)
            await self.apply_batch(batch, self.consumer)

    async def apply_batch(self, batch: list[Delivered], consumer: EventConsumer) -> None:
        """Apply what ``consumer`` fetched in one transaction, then ack. Events at or below the
        tracking sequence (redeliveries) change nothing."""
        last_seq = consumer.last_stream_seq
        if last_seq <= self.applied_seq:
            for d in batch:
                await d.ack()
            return
        changes, failed = fold_batch(self.state, batch, self.applied_seq)
        async with self._engine.begin() as conn:
            await write_changes(conn, changes)
            await write_offset(conn, self.name, EVENTS_STREAM, last_seq)
        self.applied_seq = last_seq
        for d, exc in failed:
            await consumer.dead_letter(d.msg, f"projection rule error: {exc!r}")
        failed_msgs = {id(d.msg) for d, _ in failed}
        for d in batch:
            if id(d.msg) not in failed_msgs:
                await d.ack()
