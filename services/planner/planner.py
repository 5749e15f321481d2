"""The planner process: watches the log, reads the projection, publishes decisions.

It keeps no state of its own and needs no leader. Each round it waits until the projection
has applied at least the latest event it has seen (so it never decides on an older picture
than the event that woke it), loads the cluster from the projection, runs the pure
``decide``, and publishes each decision with its deterministic message id. Any number of
planners can run at once: identical decisions are stored once (JetStream de-duplication), and
different decisions for the same instance generation are applied once (the projection rules).

Rounds run when an event that can matter arrives (nodes, models, instances, runners; not
tasks, nor a heartbeat that cannot change a decision) and on a timer, for the heartbeats that
did not arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamInfo
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import InstancePlaced, NodeTimedOut, PlacementRejected
from events.states import SERVING, STARTING
from events.subjects import Aggregate, aggregate_filter
from process.memory import EVERY_MINUTE
from projectors.projector import DEFAULT_NAME
from projectors.rows import DeviceRow, InstanceRow, ModelRow, NodeRow, RunnerRow
from projectors.state import ClusterState
from projectors.store import load_state, read_offset, unfinished_by_model, unfinished_tasks
from services.planner.decisions import (
    Decision,
    PlannerPolicy,
    decide,
    heartbeat_may_matter,
    next_timeout,
)
from services.planner.janitor import keep_tidy
from services.planner.on_demand import Busy, busy_roles
from services.resume import continuation, describe, message_id, read_logged, still_streaming

log = logging.getLogger(__name__)

# What decisions depend on; the tasks table (the big one) is not among them.
PLANNING_TABLES = (
    NodeRow.TABLE,
    DeviceRow.TABLE,
    ModelRow.TABLE,
    InstanceRow.TABLE,
    RunnerRow.TABLE,
)
WATCHED_AGGREGATES: tuple[Aggregate, ...] = ("node", "model", "instance", "runner")
WATCHED = [aggregate_filter(a) for a in WATCHED_AGGREGATES]


@dataclass
class PlannerStats:
    rounds: int = 0
    decisions: int = 0  # published and stored
    duplicates: int = 0  # published, but another planner (or an earlier round) got there first
    by_type: dict[str, int] = field(default_factory=dict)


class Planner:
    def __init__(
        self,
        nc: Client,
        engine: AsyncEngine,
        policy: PlannerPolicy | None = None,
        origin: str = "planner",
        projector: str = DEFAULT_NAME,
        tick_s: float = 0.5,
        min_round_s: float = 0.1,
        max_idle_s: float = 2.0,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        # Asks the log for its last sequence, and fails fast when it does not answer.
        self._probe = nc.jetstream(timeout=1.0)
        self._engine = engine
        self._pub = Publisher(self._js)
        self.policy = policy or PlannerPolicy()
        self.origin = origin
        self.projector = projector
        self.tick_s = tick_s
        # With nothing happening, a round is due only when a node could time out, but at least
        # this often (it also asks the log whether the subscription missed anything). Idle
        # rounds every tick took CPU here and in the nats-server, from a runner's threads on
        # the same machine (docs/placement.md).
        self.max_idle_s = max_idle_s
        # Rounds start at most this often: on a big cluster heartbeats arrive all the time, and
        # one round per batch of them is enough.
        self.min_round_s = min_round_s
        self.stats = PlannerStats()
        self._seen_seq = 0  # the latest stream sequence a round must have in its picture
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._loaded: tuple[int, ClusterState] | None = None  # the last state read, and its seq
        self._busy: Busy = {}  # unfinished tasks by model and role, read with it
        # Set when a round fails, most likely because the log did not answer (a nats-server
        # lost, a stream electing a new leader for seconds): no heartbeat could be stored
        # meanwhile, so silence counts only from the next round (``_heard_since``).
        self._log_failed = False
        self._heard_since: datetime | None = None
        # The events stream's leader when last asked: after a change (its server lost) the
        # stream had no leader for seconds, and heartbeats could not be stored meanwhile.
        self._leader: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        await ensure_streams(self._js)
        sub = await self._js.subscribe(
            WATCHED[0],
            cb=self._on_event,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, filter_subjects=WATCHED),
        )
        # Subscribed first, then the current end of the log: nothing falls in between.
        info = await self._js.stream_info(EVENTS_STREAM)
        self._note_leader(info)
        self._seen(info.state.last_seq)
        log.info("planner %s watching from seq %d", self.origin, info.state.last_seq)
        loop = asyncio.get_running_loop()
        tidying = asyncio.create_task(
            keep_tidy(self._js, self._pub, self._engine, self.origin, stop)
        )
        try:
            while not stop.is_set():
                started = loop.time()
                await self._wait_for_reason(stop)
                if stop.is_set():
                    break
                await asyncio.sleep(max(0.0, started + self.min_round_s - loop.time()))
                try:
                    await self.round()
                except Exception:  # a failed round is retried on the next one
                    log.exception("planner round failed")
                    self._log_failed = True
                    await asyncio.sleep(self.tick_s)
                EVERY_MINUTE.maybe()
        finally:
            tidying.cancel()
            await sub.unsubscribe()

    async def round(self) -> list[Decision]:
        """One look at the cluster: wait for the projection, decide, publish."""
        if self._log_failed:
            self._heard_since, self._log_failed = datetime.now(UTC), False
        target = self._seen_seq
        if self._loaded is not None and self._loaded[0] == target:
            # Nothing new came through the subscription; ask the log itself before deciding on
            # the old picture. After a nats-server restart the subscription's ordered consumer
            # is gone and nats-py re-creates it only after missed idle heartbeats (10-20 s):
            # deciding meanwhile on the picture from before the restart, while the clock moves,
            # timed out every node whose heartbeats were in fact arriving.
            info = await self._probe.stream_info(EVENTS_STREAM)
            self._note_leader(info)
            # This round loads what it found: no need to wake the next one for it.
            self._seen(info.state.last_seq, wake=False)
            target = self._seen_seq
        if self._loaded is not None and self._loaded[0] == target:
            state: ClusterState | None = self._loaded[1]  # nothing new: only the time moved
        else:
            state = await self._projection_at(target)
        if state is None:
            return []  # stopping: the projector may be gone already
        self._loaded = (target, state)
        decisions = decide(
            state, datetime.now(UTC), self.policy, self.origin, self._heard_since, self._busy
        )
        if any(isinstance(d.event, NodeTimedOut) for d in decisions):
            # Before a node is timed out: was its silence the log's? (A stream whose leader
            # changed could store nothing for a while, and its nodes' heartbeats are only now
            # being stored again.)
            self._note_leader(await self._probe.stream_info(EVENTS_STREAM))
            decisions = decide(
                state, datetime.now(UTC), self.policy, self.origin, self._heard_since, self._busy
            )
        for d in decisions:
            if isinstance(d.event, NodeTimedOut):  # its tasks go on elsewhere (resume.py)
                await self._resume_tasks_of(d.event.node_id, state)
            ack = await self._pub.publish(d.event, msg_id=d.msg_id)
            # The next round must see this decision in the projection, or it would decide it
            # again (harmlessly, but for nothing).
            self._seen(ack.seq)
            if ack.duplicate:
                self.stats.duplicates += 1
                log.info("%s was already decided (another planner, or an earlier round)", d.msg_id)
                continue
            self.stats.decisions += 1
            name = type(d.event).__name__
            self.stats.by_type[name] = self.stats.by_type.get(name, 0) + 1
            log.info("%s %s", d.msg_id, _summary(d))
        self.stats.rounds += 1
        return decisions

    async def _resume_tasks_of(self, node_id: str, state: ClusterState) -> None:
        """Continue the tasks a node's runners left unfinished: its worker is gone and cannot.
        Published before the node's ``NodeTimedOut``, so that a planner stopped in between
        leaves the decision to the next round (a continuation's message id makes a repeat
        harmless)."""
        runners = [r.runner_id for r in state.runners() if r.node_id == node_id]
        async with self._engine.connect() as conn:
            left = await unfinished_tasks(conn, runners)
        for task in left:
            logged = await read_logged(self._js, task.task_id, task.model_id)
            if still_streaming(logged, datetime.now(UTC)):
                log.info("task %s: its chunks still come, not resumed", task.task_id)
                continue
            outcome = continuation(
                logged,
                runner_id=task.runner_id or "",
                origin=self.origin,
                cause=f"was on node {node_id}, which timed out",
                at=datetime.now(UTC),
            )
            await self._pub.publish(outcome, msg_id=message_id(outcome))
            log.info("task %s: %s", task.task_id, describe(outcome))

    def _note_leader(self, info: StreamInfo) -> None:
        leader = info.cluster.leader if info.cluster is not None else None
        if self._leader is not None and leader != self._leader:
            log.info("the events stream has a new leader (%s): silence counts from now", leader)
            self._heard_since = datetime.now(UTC)
        self._leader = leader

    async def _on_event(self, msg: Msg) -> None:
        if msg.subject.endswith(".RunnerStateChanged") and not _may_matter(msg.data):
            # A runner going Running and Ready around every task: nothing to decide, and a
            # round then would compete with the runner's prompt processing for the CPU.
            return
        if msg.subject.endswith(".ResourceProfiled") and not self._heartbeat_may_matter(msg.data):
            # Every node's heartbeat (every 2 s from `shoal up`'s worker) woke a round, mostly
            # loading the planning tables, its CPU taken from the runners.
            return
        self._seen(msg.metadata.sequence.stream)

    def _heartbeat_may_matter(self, data: bytes) -> bool:
        if self._loaded is None:
            return True
        try:
            node_id = json.loads(data)["node_id"]
        except (ValueError, KeyError, TypeError):
            return True  # not for the planner to judge: let a round look
        return heartbeat_may_matter(self._loaded[1], str(node_id))

    def _seen(self, seq: int, *, wake: bool = True) -> None:
        # Only news wakes the loop: a round's own look at the log finding nothing new must not
        # start the next round (that made an idle planner go round every min_round_s).
        if seq > self._seen_seq:
            self._seen_seq = seq
            if wake:
                self._wake.set()

    async def _wait_for_reason(self, stop: asyncio.Event) -> None:
        """Until an event arrives or the tick passes (heartbeats that do not arrive are found
        only by looking)."""
        stopping = asyncio.ensure_future(stop.wait())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait(
                {stopping, woken}, timeout=self._idle_wait(), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopping.cancel()
            woken.cancel()
        self._wake.clear()

    def _idle_wait(self) -> float:
        """Seconds until the next round if no event comes: until the earliest node time-out
        (heartbeats that do not arrive are found only by looking), within tick_s..max_idle_s."""
        if self._loaded is None or self._log_failed:
            return self.tick_s
        deadline = next_timeout(self._loaded[1], self.policy, self._heard_since)
        if deadline is None:
            return self.max_idle_s
        wait = (deadline - datetime.now(UTC)).total_seconds()
        return min(max(wait, self.tick_s), self.max_idle_s)

    async def _projection_at(self, seq: int) -> ClusterState | None:
        """The planning tables once the projection has applied ``seq``; None if asked to stop
        meanwhile (in `shoal up` the projector stops with everything else)."""
        loop = asyncio.get_running_loop()
        warn_at = loop.time() + 10.0
        while True:
            async with self._engine.connect() as conn:
                try:
                    applied = await read_offset(conn, self.projector, EVENTS_STREAM)
                    if applied >= seq:
                        self._busy = busy_roles(await unfinished_by_model(conn))
                        return await load_state(conn, PLANNING_TABLES)
                except DBAPIError:  # not (fully) migrated yet: the projector is at it
                    applied = -1
            if self._stop.is_set():
                return None
            if loop.time() > warn_at:
                log.warning(
                    "projection %r is at seq %d, waiting for %d: is the projector running?",
                    self.projector,
                    applied,
                    seq,
                )
                warn_at += 30.0
            await asyncio.sleep(0.02)


def _may_matter(data: bytes) -> bool:
    """Whether a runner's state change can change a decision: a failure can (it counts
    towards moving the instance); a runner starting or serving cannot."""
    try:
        state = json.loads(data).get("state")
    except (ValueError, AttributeError):
        return True  # not for the planner to judge: let a round look
    return state not in STARTING | SERVING


def _summary(d: Decision) -> str:
    e = d.event
    if isinstance(e, InstancePlaced):
        where = ", ".join(
            f"{s.node_id}:{s.device}[{s.start_layer}:{s.end_layer}]" for s in e.shards
        )
        slots = f", {e.slots} slots" if e.slots is not None and e.slots > 1 else ""
        return f"placed {e.model_id} on {where}{slots}" + (f" ({e.reason})" if e.reason else "")
    if isinstance(e, PlacementRejected):
        return f"rejected {e.model_id}: {e.reason}"
    if isinstance(e, NodeTimedOut):
        return f"node {e.node_id} timed out after {e.missed_heartbeats} missed heartbeats"
    return f"instance {e.instance_id} deleted"
