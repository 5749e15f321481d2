"""What the planner decides, as a pure function of the projection and the time:
``decide(state, now, policy) -> [Decision]``.

It looks at the whole state every time (level-triggered), so a missed or repeated event
changes nothing, and two planners looking at the same state decide the same. Each decision
carries a deterministic message id, so JetStream keeps one of identical decisions, and each
placement decision carries the instance's next generation, so the projection applies at most
one decision per generation even when two planners decided differently.

- A node silent for ``missed_heartbeats`` of its heartbeat intervals: ``NodeTimedOut``.
- An instance being deleted: ``InstanceDeleted``.
- An instance requested: ``InstancePlaced`` or ``PlacementRejected``.
- A placed instance with a shard on a node that is gone, or a runner that failed
  ``failure_limit`` times within ``failure_window_s``: placed again (keeping the replicas that
  are fine, avoiding the failing device), or rejected with the reason.
- A rejected instance: placed when it fits now (a node joined, a model was added...);
  otherwise nothing, so a rejection is said once, not at every heartbeat.
- An instance made on demand, idle past its keep-alive: ``InstanceDeleted``; and idle ones,
  least recently used first, to make room for an instance that does not fit (memory, or a
  node's limit on loaded instances) (``on_demand.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from events.catalogue import (
    InstanceDeleted,
    InstancePlaced,
    NodeTimedOut,
    PlacementRejected,
)
from events.states import INSTANCE_UNPLACED
from projectors.rows import InstanceRow, NodeRow, RunnerRow
from projectors.rules import changes_for
from projectors.state import ClusterState
from services.planner import on_demand
from services.planner.cluster import ClusterView, charges_of, cluster_view
from services.planner.on_demand import DEFAULT_KEEP_ALIVE_S, Busy
from services.planner.placement import (
    ModelInfo,
    Placement,
    PlacementRequest,
    Rejection,
    place,
)

DecisionEvent = NodeTimedOut | InstanceDeleted | InstancePlaced | PlacementRejected


@dataclass(frozen=True)
class PlannerPolicy:
    missed_heartbeats: int = 3
    default_heartbeat_s: float = 2.0  # for nodes that did not say their interval
    failure_limit: int = 3
    failure_window_s: float = 120.0
    # An on-demand instance's keep-alive when it has none of its own (shoal planner --keep-alive).
    default_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    # The most instances a node holds (shoal planner --max-loaded; None: as memory allows).
    max_loaded: int | None = None


@dataclass(frozen=True)
class Decision:
    event: DecisionEvent
    msg_id: str


def decide(
    state: ClusterState,
    now: datetime,
    policy: PlannerPolicy,
    origin: str = "planner",
    heard_since: datetime | None = None,
    busy: Busy | None = None,
) -> list[Decision]:
    """The decisions ``state`` calls for at ``now``. Later decisions in the list see the
    effect of earlier ones (a timed-out node is not placed on), as the projection will.
    ``heard_since``: since when the log could store heartbeats (after it could not, e.g. while
    a stream elected a new leader); a node's silence before then does not count. ``busy``:
    the unfinished tasks of each model and role (their instances are not unloaded)."""
    busy = busy or {}
    scratch = state.copy()
    decisions: list[Decision] = []

    def emit(event: DecisionEvent, msg_id: str) -> None:
        decisions.append(Decision(event, msg_id))
        scratch.commit(changes_for(scratch, event))

    for node in state.nodes():
        silence = _silence(node, now, policy, heard_since)
        if silence is not None:
            assert node.last_seen is not None
            event = NodeTimedOut(
                node_id=node.node_id,
                origin=origin,
                last_seen=node.last_seen,
                missed_heartbeats=silence,
                ts=now,
            )
            emit(event, f"timedout:{node.node_id}:{node.last_seen.isoformat()}")

    instances = sorted(
        state.instances(),
        key=lambda i: (i.requested_at is None, i.requested_at, i.instance_id),
    )
    for inst in instances:
        if inst.status == "deleting":
            emit(
                InstanceDeleted(
                    instance_id=inst.instance_id, origin=origin, reason=inst.reason or "", ts=now
                ),
                f"deleted:{inst.instance_id}",
            )
    for inst in on_demand.idle(state, now, busy, policy.default_keep_alive_s):
        since = on_demand.last_used(inst)
        keep = on_demand.keep_alive_s(inst, policy.default_keep_alive_s)
        emit(
            InstanceDeleted(
                instance_id=inst.instance_id,
                origin=origin,
                reason=f"unloaded: idle for {keep:g} s (its keep-alive)",
                ts=now,
            ),
            f"idle:{inst.instance_id}:{since.isoformat() if since else ''}",
        )
    # Built once, after time-outs and deletions, and kept up to date with each placement:
    # rebuilt per instance, it made a large cluster's round slow (docs/placement.md).
    runners: dict[str, list[RunnerRow]] = defaultdict(list)
    for row in scratch.runners():
        runners[row.instance_id].append(row)
    view: ClusterView | None = None
    for inst in instances:
        current = scratch.instance(inst.instance_id)
        assert current is not None
        own = sorted(runners.get(inst.instance_id, []), key=lambda r: (r.replica, r.rank))
        why = _why_place(scratch, current, own, policy)
        if why is None:
            continue
        if view is None:
            view = cluster_view(scratch)
        others = view.release(charges_of(scratch, own))
        request = _request(scratch, current, own, why)
        victims, others = _room_for(scratch, request, others, busy, policy.max_loaded)
        for victim in victims:
            emit(
                InstanceDeleted(
                    instance_id=victim.instance_id,
                    origin=origin,
                    reason=f"unloaded to make room for {current.model_id} ({current.instance_id})",
                    ts=now,
                ),
                f"room:{victim.instance_id}:{current.instance_id}:{request.generation}",
            )
        loaded = on_demand.loaded_per_node(scratch, excluding=[current.instance_id])
        limited = on_demand.within_limit(others, loaded, policy.max_loaded)
        result = _place(scratch, current, request, why, limited, now, origin, emit)
        if isinstance(result, Placement):
            view = others.reserve(result.charges)
        elif current.status != "rejected":
            view = others  # rejected now: its runners stop
    return decisions


@dataclass(frozen=True)
class _Why:
    reason: str  # '' for a first placement
    avoid: frozenset[str]
    failures: tuple[tuple[str, str], ...] = ()  # the failing runners' errors, by device


def _why_place(
    state: ClusterState, inst: InstanceRow, runners: list[RunnerRow], policy: PlannerPolicy
) -> _Why | None:
    """Why ``inst`` needs placing now, or None when it does not."""
    avoid = frozenset(inst.avoid or [])
    if inst.status in INSTANCE_UNPLACED:
        return _Why("", avoid)
    if inst.status != "placed":
        return None
    gone = sorted({r.node_id for r in runners if _node_status(state, r.node_id) != "online"})
    failing = [r for r in runners if _failing(r, policy)]
    if not gone and not failing:
        return None
    reasons = [f"node {n} is {_node_status(state, n).replace('_', ' ')}" for n in gone]
    failures = []
    for r in failing:
        ref = f"{r.node_id}:{r.device}"
        avoid |= {ref}
        failures.append((ref, r.error or "no error given"))
        reasons.append(
            f"runner {r.runner_id} failed {_recent_failures(r, policy)} times within"
            f" {policy.failure_window_s:g} s on {ref} ({r.error or 'no error given'})"
        )
    return _Why("; ".join(reasons), avoid, tuple(failures))


def _request(
    state: ClusterState, inst: InstanceRow, runners: list[RunnerRow], why: _Why
) -> PlacementRequest:
    model = state.model(inst.model_id)
    return PlacementRequest(
        instance_id=inst.instance_id,
        model=ModelInfo.of(model) if model is not None else None,
        replicas=inst.replicas,
        context_length=inst.context_length,
        spec=inst.placement,
        role=inst.role,
        generation=inst.generation + 1,
        avoid=why.avoid,
        failures=why.failures,
        current=tuple(r.shard() for r in runners) if inst.status == "placed" else (),
        slots=inst.requested_slots,
        current_slots=inst.slots,
        kv_cache=inst.requested_kv_cache,
        current_kv_cache=inst.kv_cache if inst.status == "placed" else None,
    )


def _room_for(
    state: ClusterState,
    request: PlacementRequest,
    view: ClusterView,
    busy: Busy,
    max_loaded: int | None,
) -> tuple[list[InstanceRow], ClusterView]:
    """The idle on-demand instances to unload so that ``request`` fits (least recently used
    first, as few as it takes), and the view without them; none when it fits already, or
    would not fit even with all of them gone."""
    if request.model is None:
        return [], view
    loaded = on_demand.loaded_per_node(state, excluding=[request.instance_id])
    if isinstance(place(on_demand.within_limit(view, loaded, max_loaded), request), Placement):
        return [], view
    victims, freed = [], view
    for victim in on_demand.evictable(state, busy, sparing=request.instance_id):
        victims.append(victim)
        freed = freed.release(charges_of(state, state.runners_of(victim.instance_id)))
        for held in loaded.values():
            held.discard(victim.instance_id)
        if isinstance(place(on_demand.within_limit(freed, loaded, max_loaded), request), Placement):
            return victims, freed
    return [], view


def _place(
    state: ClusterState,
    inst: InstanceRow,
    request: PlacementRequest,
    why: _Why,
    view: ClusterView,
    now: datetime,
    origin: str,
    emit: Callable[[DecisionEvent, str], None],
) -> Placement | Rejection:
    """Place ``inst`` on ``view`` (which does not count its own shards) and emit the decision:
    a placement, or a rejection unless it was rejected already."""
    model = state.model(inst.model_id)
    result = place(view, request)
    msg_id = f"placement:{inst.instance_id}:{request.generation}"
    reason = why.reason
    if isinstance(result, Placement):
        event: DecisionEvent = InstancePlaced(
            instance_id=inst.instance_id,
            model_id=inst.model_id,
            origin=origin,
            shards=list(result.shards),
            generation=request.generation,
            reason=reason,
            avoid=sorted(why.avoid),
            slots=result.slots,
            kv_cache=result.kv_cache,
            ts=now,
        )
        emit(event, msg_id)
    elif inst.status != "rejected":
        cause = result.reason
        if model is None:
            cause = f"model {inst.model_id!r} is not known to the cluster: add it with"
            cause += f" `shoal models add {inst.model_id}`"
        emit(
            PlacementRejected(
                instance_id=inst.instance_id,
                model_id=inst.model_id,
                origin=origin,
                reason=f"{reason}; and it cannot be placed again: {cause}" if reason else cause,
                needed_bytes=result.needed_bytes,
                available_bytes=result.available_bytes,
                generation=request.generation,
                avoid=sorted(why.avoid),
                ts=now,
            ),
            msg_id,
        )
    return result


def heartbeat_may_matter(state: ClusterState, node_id: str) -> bool:
    """Whether a heartbeat of ``node_id`` (its resources now) can change what ``decide`` makes
    of ``state``: when the node is not known to be online (it joins, or comes back), or an
    instance waits for a place (more free memory may make it fit). Otherwise only the node's
    time-out moves, and a planner looks at that when it is due (``next_timeout``)."""
    node = state.node(node_id)
    if node is None or node.status != "online":
        return True
    return any(i.status in INSTANCE_UNPLACED for i in state.instances())


def next_timeout(
    state: ClusterState, policy: PlannerPolicy, heard_since: datetime | None = None
) -> datetime | None:
    """The earliest moment an online node times out if no heartbeat of it arrives: when a
    planner must look again although nothing happened (None: no node to watch)."""
    deadlines = []
    for node in state.nodes():
        if node.status != "online" or node.last_seen is None:
            continue
        interval = node.heartbeat_s or policy.default_heartbeat_s
        since = node.last_seen if heard_since is None else max(node.last_seen, heard_since)
        deadlines.append(since + timedelta(seconds=interval * policy.missed_heartbeats))
    return min(deadlines, default=None)


def _silence(
    node: NodeRow, now: datetime, policy: PlannerPolicy, heard_since: datetime | None = None
) -> int | None:
    """Heartbeats missed, when that is enough to time the node out; else None."""
    if node.status != "online" or node.last_seen is None:
        return None
    interval = node.heartbeat_s or policy.default_heartbeat_s
    since = node.last_seen if heard_since is None else max(node.last_seen, heard_since)
    missed = int((now - since).total_seconds() // interval)
    return missed if missed >= policy.missed_heartbeats else None


def _recent_failures(runner: RunnerRow, policy: PlannerPolicy) -> int:
    """Failures within the window that ends at the runner's latest failure."""
    times = [datetime.fromisoformat(t) for t in runner.failure_times or []]
    if not times:
        return 0
    latest = max(times)
    return sum(1 for t in times if (latest - t).total_seconds() <= policy.failure_window_s)


def _failing(runner: RunnerRow, policy: PlannerPolicy) -> bool:
    return runner.state == "Failed" and _recent_failures(runner, policy) >= policy.failure_limit


def _node_status(state: ClusterState, node_id: str) -> str:
    node = state.node(node_id)
    return node.status if node is not None else "unknown"
