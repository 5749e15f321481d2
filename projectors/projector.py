"""The live projector: folds SHOAL_EVENTS into the projection database.

Each fetched batch is applied in ONE transaction together with the events it counted by type
and the tracking row ``(projector, stream, last_seq)``; its dead letters are published before
that commit, and messages are acked only after it. The database, not the consumer, is the
source of truth for where the projector stands: at every start the durable consumer is
re-created at ``last_seq + 1``, so a crash, a redelivery or a database restored from a backup
never applies an event twice or skips one.

The projector keeps the projection in memory too (it is the only writer, so memory and database
cannot drift) and runs the pure rules against it; only the net row changes of a batch are
written. One projector per database and name: a second one fails at start (it cannot hold the
database), and the tracking row moves by compare-and-set, so that no projector ever overwrites
another's.

A batch of task events only (most of the log) waits ``task_linger_s`` for more before it is
written: fewer transactions under load, and none while a runner processes the prompt of the
task it was just given (on a machine whose cores it uses, that work came out of its time to
first token). The tasks in the projection are that much later; events that steer the cluster
(nodes, models, instances, runners) are written as soon as they come, and one of a node, model
or instance heard (live) while task events linger ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.consumer import PULL_WAIT_S, Delivered, EventConsumer
from bus.log_position import check_position
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, StreamSettings, ensure_streams
from events.catalogue import LogTailLost, subject_event_type
from events.subjects import ALL_EVENTS, aggregate_filter, aggregate_prefix
from process.memory import EVERY_MINUTE, give_back
from projectors import database, snapshot
from projectors.residency import read_history
from projectors.rules import changes_for
from projectors.state import Change, ClusterState
from projectors.store import (
    OffsetConflict,
    UnstorableError,
    check_storable,
    load_live_state,
    read_counts,
    read_offset,
    read_tracking,
    write_changes,
    write_counts,
    write_offset,
)

log = logging.getLogger(__name__)

DEFAULT_NAME = "main"


def tune_gc() -> None:
    """Collect garbage less often in a process that folds events.

    Parsing and folding allocate many short-lived objects, and with Python's default thresholds
    the collector takes a large share of a catch-up (bench/projector.py measures it). Freezing
    what start-up allocated and raising the young-generation threshold keeps its pauses short.
    Called by the processes that run a projector or a replay, not on import.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# A snapshot of the projection (projectors/snapshot.py) after this many events, or this long
# with any event since the last.
SNAPSHOT_EVERY = 100_000
SNAPSHOT_EVERY_S = 6 * 3600.0

# How long a batch of task events only waits for more (see above).
TASK_LINGER_S = 0.25
_TASK_SUBJECTS = aggregate_prefix("task")
# Events that steer the cluster: one heard live ends a linger at once, as a planner's round
# (a model loaded on demand, evicting another whose task just ended) waits for the projection.
# Not a runner's: each task makes two (Running, Ready), and a transaction at each took CPU from
# the next task's prompt (a runner's Ready after its load comes with no task events to linger).
_STEERING = tuple(aggregate_filter(a) for a in ("node", "model", "instance"))

# A projection that ran this long before an error starts its retries from the shortest wait
# again (a restart of the nats-server loses its consumer each time, see run()).
BACKOFF_RESET_S = 30.0


class ProjectionLost(RuntimeError):
    """Events the projection needs are gone from the log and no snapshot covers them: the
    projector stops rather than project a history with a hole in it."""


class ProjectionGap(RuntimeError):
    """A fetch skipped events the stream still holds: the projector resumes from its last
    commit rather than apply what came after them."""


def fold_batch(
    state: ClusterState, batch: Sequence[Delivered], after_seq: int
) -> tuple[list[Change], list[tuple[Delivered, Exception]]]:
    """Apply a batch to ``state`` in stream order (skipping sequences ``<= after_seq`` and
    repeats, i.e. redeliveries). Returns the changes to write and the events whose rule raised,
    or whose rows the database cannot hold (to be dead-lettered)."""
    changes: list[Change] = []
    failed: list[tuple[Delivered, Exception]] = []
    for d in sorted(batch, key=lambda d: d.stream_seq):
        if d.stream_seq <= after_seq:
            continue
        after_seq = d.stream_seq
        try:
            ch = changes_for(state, d.event)
            check_storable(ch)
        except Exception as exc:  # a rule bug on one event must not stop the projection
            failed.append((d, exc))
            continue
        state.commit(ch)
        changes.extend(ch)
    return changes, failed


def counted(counts: Mapping[str, int], subjects: Iterable[str]) -> dict[str, int]:
    """The new totals of the types these subjects name (``subject_event_type``), from
    ``counts``: what to write for a batch of messages. Subjects of no known type count
    nowhere."""
    added = Counter(t for s in subjects if (t := subject_event_type(s)) is not None)
    return {kind: counts.get(kind, 0) + n for kind, n in added.items()}


class Projector:
    def __init__(
        self,
        js: JetStreamContext,
        engine: AsyncEngine,
        name: str = DEFAULT_NAME,
        batch_size: int = 2000,
        stream_settings: StreamSettings | None = None,
        task_linger_s: float = TASK_LINGER_S,
        after_dead_letters: Callable[[], None] | None = None,
        snapshot_every: int = SNAPSHOT_EVERY,
        snapshot_every_s: float = SNAPSHOT_EVERY_S,
    ) -> None:
        """``after_dead_letters``: called once a batch's dead letters are published, before
        that batch's commit (a fault test kills the process there). A snapshot of the
        projection is written after ``snapshot_every`` events, or ``snapshot_every_s`` seconds
        with events since the last (0: never)."""
        self._js = js
        self._after_dead_letters = after_dead_letters
        self._engine = engine
        self.name = name
        self.batch_size = batch_size
        self.task_linger_s = task_linger_s
        self._stream_settings = stream_settings
        self.applied_seq = 0
        self.state = ClusterState()
        self.counts: dict[str, int] = {}  # events by type up to applied_seq
        self.consumer: EventConsumer | None = None
        self.ready = asyncio.Event()
        self.snapshot_every = snapshot_every
        self.snapshot_every_s = snapshot_every_s
        self.snapshot_seq = 0  # the newest snapshot's sequence
        self._snapshot_at = 0.0  # loop time of the last snapshot (or of the start)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Project until ``stop`` is set (or forever). Database errors are retried with backoff
        from the last committed state."""
        stop = stop or asyncio.Event()
        await ensure_streams(self._js, self._stream_settings)
        await database.upgrade(self._engine)
        try:
            async with database.projector_hold(self._engine, self.name):
                await self._run(stop)
        except (database.ProjectorRunning, OffsetConflict, ProjectionLost) as exc:
            log.critical("projector %s stops: %s", self.name, exc)
            raise
        finally:
            if self.consumer is not None:
                await self.consumer.stop()

    async def _run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.5
        while not stop.is_set():
            started = loop.time()
            try:
                await self._project(stop)
            except (SQLAlchemyError, nats.errors.Error, ProjectionGap) as exc:
                log.error("projector error, resuming from the last commit: %s", exc)
                if loop.time() - started > BACKOFF_RESET_S:  # it had been working: new trouble
                    backoff = 0.5
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _project(self, stop: asyncio.Event) -> None:
        await self._check_log_position()
        await self._start_from_snapshot()
        async with self._engine.connect() as conn:
            self.state = await load_live_state(conn)
            self.applied_seq = await read_offset(conn, self.name, EVENTS_STREAM)
            self.counts = await read_counts(conn, self.name, EVENTS_STREAM)
        if self.consumer is not None:
            await self.consumer.stop()
        self.consumer = EventConsumer(
            self._js,
            EVENTS_STREAM,
            durable=f"projector-{self.name}",
            filter_subject=ALL_EVENTS,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.applied_seq + 1,
            max_ack_pending=self.batch_size * 2,
            # Where it got to is in the database: made again from there when it is lost.
            memory=True,
            # A batch is committed whole: one ack for it, dead letters included.
            ack_all=True,
        )
        await self.consumer.start(recreate=True)
        log.info("projector %s resuming after seq %d", self.name, self.applied_seq)
        self.ready.set()
        steered = asyncio.Event()

        async def heard(_msg: Msg) -> None:
            steered.set()

        nc = self._js._nc  # the context has no public accessor for its client
        subs = [await nc.subscribe(subject, cb=heard) for subject in _STEERING]
        try:
            await self._fold(stop, self.consumer, steered)
        finally:
            for sub in subs:
                await sub.unsubscribe()

    async def _fold(
        self, stop: asyncio.Event, consumer: EventConsumer, steered: asyncio.Event
    ) -> None:
        while not stop.is_set():
            steered.clear()
            batch = await consumer.fetch(self.batch_size, timeout=PULL_WAIT_S, stop=stop)
            if self._lingers(batch):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(steered.wait(), self.task_linger_s)
                left = self.batch_size - len(batch)
                batch += await consumer.fetch(left, timeout=0.5, more=True)
            await self.apply_batch(batch, consumer)
            if len(batch) < self.batch_size:
                # Live, a few events a batch: the young garbage goes now. With tune_gc's
                # threshold a light load would reach a collection only after minutes, holding
                # every cycle the database layer made meanwhile (bench/soak.py's projector curve).
                gc.collect(1)
            EVERY_MINUTE.maybe()
            if self._snapshot_due():
                await self._snapshot()

    async def _start_from_snapshot(self) -> None:
        """Restore the newest snapshot into a database that has nothing yet, or one so far
        behind that the events it needs next are gone from the log (their age passed the
        stream's limit); a gap no snapshot covers stops the projector (ProjectionLost)."""
        async with self._engine.connect() as conn:
            applied = await read_offset(conn, self.name, EVENTS_STREAM)
        info = await self._js.stream_info(EVENTS_STREAM)
        first = info.state.first_seq
        if (max_age := info.config.max_age or 0.0) > 0 and self.snapshot_every > 0:
            # Snapshots well within the log's age limit: an event ages out only after a
            # snapshot holds what it did.
            self.snapshot_every_s = min(self.snapshot_every_s or max_age / 4, max_age / 4)
        snapshots = await snapshot.listed(self._js, self.name)
        self.snapshot_seq = snapshots[-1].seq if snapshots else 0
        self._snapshot_at = asyncio.get_running_loop().time()
        newest = snapshot.chosen(
            await snapshot.of_this_log(self._js, snapshots, info.state.last_seq), None
        )
        gap = applied + 1 < first
        if gap and (newest is None or newest.seq < first - 1):
            raise ProjectionLost(
                f"projector {self.name} is at seq {applied}, and the log's oldest event is"
                f" #{first}: events {applied + 1}..{first - 1} are gone and no snapshot of"
                f" {self.name} covers them (newest: {newest.seq if newest else 'none'})"
            )
        if newest is not None and newest.seq > applied and (applied == 0 or gap):
            await snapshot.restore(self._engine, self._js, newest)

    async def _check_log_position(self) -> None:
        """At every (re)start, before anything is applied: does the tracking row still name
        the log's own event? A log that went back behind it (``bus/log_position.py``) had
        the projection rebuilt from what it still holds, the loss published (``LogTailLost``)
        and logged; never is a newer event under an old number taken for the one applied."""
        async with self._engine.connect() as conn:
            seq, kept = await read_tracking(conn, self.name, EVENTS_STREAM)
        log_state = (await self._js.stream_info(EVENTS_STREAM)).state
        last = log_state.last_seq
        at = await snapshot.digest_at(self._js, seq) if 0 < seq <= last else None
        verdict = check_position(seq, kept, last, at)
        if not verdict.lost:
            return
        snapshots = await snapshot.listed(self._js, self.name)
        usable = await snapshot.of_this_log(self._js, snapshots, last)
        # The newest one the log still holds, and everything after.
        start = snapshot.chosen([s for s in usable if s.seq >= log_state.first_seq - 1], None)
        log.critical(
            "THE EVENT LOG LOST ITS TAIL: projector %s had applied up to #%d; %s. Rebuilding"
            " the projection from %s and the log (docs/operations.md, 'Power cuts and crashes')",
            self.name,
            seq,
            verdict.dropped,
            f"snapshot {start.name}" if start else "nothing",
        )
        # Published before the rebuild: a crash between the two has it noticed (and the
        # same message id published) again.
        await Publisher(self._js).publish(
            LogTailLost(
                origin=f"projector:{self.name}",
                reader=f"projector:{self.name}",
                tracking_seq=seq,
                stream_last_seq=last,
                dropped=verdict.dropped,
                rebuilt_from_seq=start.seq if start else 0,
            ),
            msg_id=f"log-tail-lost:{self.name}:{seq}:{kept}",
        )
        if start is None and log_state.first_seq > 1:
            # Kept as it is for the operator, rather than emptied for a rebuild that cannot be.
            raise ProjectionLost(
                f"projector {self.name}: the log lost its tail and cannot be rebuilt from: its"
                f" oldest event is #{log_state.first_seq} and no snapshot of {self.name} that"
                " it still holds covers the events before"
            )
        # Snapshots of the history the log lost would be restored some day, or outrank the
        # new ones (they are kept by sequence).
        for gone in snapshots:
            if gone not in usable:
                await snapshot.remove(self._js, gone)
        await snapshot.clear(self._engine)  # _start_from_snapshot restores `start`, if any

    def _snapshot_due(self) -> bool:
        if self.snapshot_every <= 0 or self.applied_seq <= self.snapshot_seq:
            return False
        if self.applied_seq - self.snapshot_seq >= self.snapshot_every:
            return True
        waited = asyncio.get_running_loop().time() - self._snapshot_at
        return self.snapshot_every_s > 0 and waited >= self.snapshot_every_s

    async def _snapshot(self) -> None:
        """Write a snapshot between two batches (nothing writes meanwhile): a failure is
        logged and tried again after the next batch."""
        self._snapshot_at = asyncio.get_running_loop().time()
        try:
            made = await snapshot.write(self._engine, self._js, self.name)
        except (SQLAlchemyError, nats.errors.Error, OSError) as exc:
            log.warning("projector %s could not write a snapshot: %r", self.name, exc)
            return
        finally:
            give_back()  # the snapshot's pages, read and written, are not kept to the next one
        self.snapshot_seq = made.seq

    def _lingers(self, batch: list[Delivered]) -> bool:
        """Whether ``batch`` waits for more before it is written: task events only, room left."""
        if not batch or len(batch) >= self.batch_size or self.task_linger_s <= 0:
            return False
        return all(d.msg.subject.startswith(_TASK_SUBJECTS) for d in batch)

    async def apply_batch(self, batch: list[Delivered], consumer: EventConsumer) -> None:
        """Apply what ``consumer`` fetched in one transaction, then ack. Events at or below the
        tracking sequence (redeliveries) change nothing; events after a gap are not applied
        (``ProjectionGap``)."""
        last_seq = consumer.last_stream_seq
        if last_seq <= self.applied_seq:
            await consumer.ack_fetched()
            return
        await self._check_contiguous(consumer.fetched_seqs)
        await read_history(self._engine, self.state, [d.event for d in batch])
        changes, failed = fold_batch(self.state, batch, self.applied_seq)
        subjects = (
            s for seq, s in consumer.fetched_subjects.items() if self.applied_seq < seq <= last_seq
        )
        counts = counted(self.counts, subjects)
        # Dead letters before the commit: after it, a crash would lose them (the tracking row has
        # moved past their events). A crash before it has them published again after the
        # restart, which their message ids (dead:<stream>:<seq>) make harmless.
        for d, exc in failed:
            reason = (
                f"cannot be stored: {exc}"
                if isinstance(exc, UnstorableError)
                else f"projection rule error: {exc!r}"
            )
            await consumer.dead_letter(d.msg, reason)
        if failed and self._after_dead_letters is not None:
            self._after_dead_letters()
        async with self._engine.begin() as conn:
            await write_changes(conn, changes)
            await write_counts(conn, self.name, EVENTS_STREAM, counts)
            await write_offset(
                conn, self.name, EVENTS_STREAM, last_seq, self.applied_seq, consumer.last_digest
            )
        self.applied_seq = last_seq
        self.counts.update(counts)
        self.state.forget_history()
        await consumer.ack_fetched()

    async def _check_contiguous(self, fetched: list[int]) -> None:
        """The projector's filter takes every subject of the stream, so what follows the
        tracking sequence must come without a hole. A pull consumer can leave one: messages it
        delivered that never arrived (their consumer leader's server lost on the way) come again
        only after the ack wait, behind newer ones, which would then be applied first, and the
        lost ones skipped as redeliveries."""
        new = sorted({s for s in fetched if s > self.applied_seq})
        if not new or new[-1] - self.applied_seq == len(new):
            return
        have = set(new)
        missing = max(s for s in range(self.applied_seq + 1, new[-1]) if s not in have)
        try:
            await self._js.get_msg(EVENTS_STREAM, missing)
        except NotFoundError:
            return  # aged out or removed before it was projected: nothing to wait for
        raise ProjectionGap(f"seq {missing} was not delivered; resuming after {self.applied_seq}")
