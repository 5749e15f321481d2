"""The transition rules: what each event changes in the projection.

``changes_for(state, event)`` is a pure function: it reads ``state``, never modifies it, and
returns the row changes the event implies. The SQL projector, replay and any in-memory fold all
use it, so they cannot disagree. Rules use only the event's own data (``ts``, never the wall
clock), so folding the same log always gives the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import Any, assert_never

from bus.events import (
    ChunkGenerated,
    EmbeddingsComputed,
    EmbeddingsRequested,
    Event,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    KeyAdded,
    KeyRevoked,
    ModelAdded,
    ModelEvicted,
    ModelRemoved,
    NodeJoined,
    NodeLeft,
    NodeTimedOut,
    PlacementRejected,
    PromptScored,
    ResourceProfiled,
    ResponseDeleted,
    ResponseStored,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
)
from bus.kinds import InstanceRole, role_of_task
from bus.records import NodeProfile, PartRef
from bus.states import INSTANCE_ENDING, TASK_ENDED, NodeStatus, TaskStatus
from projectors.rows import (
    DeviceRow,
    InstanceRow,
    KeyRow,
    ModelRow,
    NodeRow,
    ResponseRow,
    RunnerRow,
    TaskRow,
    UsageRow,
)
from projectors.state import Change, ClusterState, Delete, Put

RECENT_FAILURES = 10  # failure times kept per runner, for the planner's "fails too often"


def changes_for(state: ClusterState, event: Event) -> list[Change]:
    # Exhaustive: mypy fails on assert_never below when an event type has no case, so a new
    # type gets a rule, or is declared projection-free, as it is added.
    match event:
        # The most frequent first: each case is an isinstance check.
        case TaskCreated():
            return _task_created(state, event)
        case TaskStarted():
            return _task_started(state, event)
        case TaskCompleted():
            return _task_completed(state, event)
        case TaskFailed():
            return _task_failed(state, event)
        case TaskCancelled():
            return _task_cancelled(state, event)
        case EmbeddingsRequested():
            return _embeddings_requested(state, event)
        case ResourceProfiled():
            return _resource_profiled(state, event)
        case RunnerStateChanged():
            return _runner_state_changed(state, event)
        case NodeJoined():
            return _node_joined(state, event)
        case NodeLeft():
            return _node_left(state, event)
        case NodeTimedOut():
            return _node_timed_out(state, event)
        case ModelAdded():
            return _model_added(state, event)
        case ModelRemoved():
            return _model_removed(state, event)
        case InstanceRequested():
            return _instance_requested(state, event)
        case InstancePlaced():
            return _instance_placed(state, event)
        case PlacementRejected():
            return _placement_rejected(state, event)
        case InstanceDeleteRequested():
            return _instance_delete_requested(state, event)
        case InstanceDeleted():
            return _instance_deleted(state, event)
        case ResponseStored():
            return _response_stored(state, event)
        case ResponseDeleted():
            return _response_deleted(state, event)
        case KeyAdded():
            return _key_added(state, event)
        case KeyRevoked():
            return _key_revoked(state, event)
        case ChunkGenerated() | PromptScored() | EmbeddingsComputed():
            return []  # projection-free: the chunk stream's; the projection keeps task outcomes
        case ModelEvicted():
            return []  # projection-free: what one node's disk holds is that node's business
        case _:
            assert_never(event)


def fold(events: Iterable[Event], state: ClusterState | None = None) -> ClusterState:
    """Apply ``events`` in order to ``state`` (a fresh one by default) and return it."""
    state = state if state is not None else ClusterState()
    for event in events:
        state.commit(changes_for(state, event))
    return state


# --- nodes --------------------------------------------------------------------------------


def _node_joined(state: ClusterState, e: NodeJoined) -> list[Change]:
    old = state.node(e.node_id) or NodeRow(node_id=e.node_id, status="online")
    row = replace(
        old,
        status="online",
        hostname=e.hostname,
        addresses=list(e.addresses),
        version=e.version,
        heartbeat_s=e.heartbeat_s,
        joined_at=e.ts,
        left_at=None,
        last_seen=e.ts,
    )
    return [Put(row)]


def _node_left(state: ClusterState, e: NodeLeft) -> list[Change]:
    old = state.node(e.node_id)
    if old is None:
        return []
    return [Put(replace(old, status="left", left_at=e.ts))]


def _node_timed_out(state: ClusterState, e: NodeTimedOut) -> list[Change]:
    old = state.node(e.node_id)
    if old is None or old.status == "left":
        return []
    return [Put(replace(old, status="timed_out", left_at=e.ts))]


def _device_rows(node_id: str, p: NodeProfile) -> list[DeviceRow]:
    cpu = DeviceRow(
        node_id=node_id,
        device="cpu",
        kind="cpu",
        name=p.cpu_model,
        memory_total=p.ram_total,
        memory_used=p.ram_total - p.ram_available,
        utilisation=p.cpu_load,
    )
    gpus = [
        DeviceRow(
            node_id=node_id,
            device=f"gpu{g.index}",
            kind="gpu",
            name=g.name,
            memory_total=g.memory_total,
            memory_used=g.memory_used,
            utilisation=g.utilisation,
        )
        for g in p.gpus
    ]
    accelerators = [
        DeviceRow(
            node_id=node_id,
            device=a.device,
            kind="gpu",
            name=a.name,
            memory_total=a.memory_total,
            memory_used=a.memory_total - a.memory_free if a.memory_free is not None else 0,
            utilisation=a.utilisation,
            backend=a.backend,
            memory_free=a.memory_free,
            unified=a.unified,
            compute_capability=a.compute_capability,
            engines=list(a.engines),
        )
        for a in p.accelerators
    ]
    return [cpu, *gpus, *accelerators]


def _resource_profiled(state: ClusterState, e: ResourceProfiled) -> list[Change]:
    p = e.profile
    old = state.node(e.node_id) or NodeRow(node_id=e.node_id, status="online", joined_at=e.ts)
    # A heartbeat after a time-out brings the node back; one after a clean leave does not.
    status: NodeStatus = "left" if old.status == "left" else "online"
    row = replace(
        old,
        status=status,
        last_seen=e.ts,
        ram_total=p.ram_total,
        ram_available=p.ram_available,
        swap_total=p.swap_total,
        swap_used=p.swap_used,
        cpu_count=p.cpu_count,
        cpu_model=p.cpu_model,
        cpu_load=p.cpu_load,
        disk_free=p.disk_free,
        memory_offered=p.memory_offered,
        interfaces=[i.model_dump() for i in p.interfaces],
    )
    changes: list[Change] = [Put(row)]
    wanted = _device_rows(e.node_id, p)
    wanted_keys = {d.key() for d in wanted}
    changes += [
        Delete(DeviceRow.TABLE, d.key())
        for d in state.devices_of(e.node_id)
        if d.key() not in wanted_keys
    ]
    changes += [Put(d) for d in wanted]
    return changes


# --- models -------------------------------------------------------------------------------


def _model_added(state: ClusterState, e: ModelAdded) -> list[Change]:
    row = ModelRow(
        model_id=e.model_id,
        n_layers=e.n_layers,
        size_bytes=e.size_bytes,
        family=e.family,
        context_length=e.context_length,
        engines=list(e.engines),
        chat_format=e.chat_format,
        source=e.source,
        path=e.path,
        added_at=e.ts,
        kv_bytes_per_token=e.kv_bytes_per_token,
        overhead_bytes=e.overhead_bytes,
        # None rather than [] when there are none: the row of an event from before the bucket.
        files=[f.model_dump() for f in e.files] or None,
        node_id=e.node_id,
    )
    return [Put(row)]


def _model_removed(state: ClusterState, e: ModelRemoved) -> list[Change]:
    # Refused at the edge while a live instance uses it; an instance row that names it later
    # is placed as any instance of an unknown model is (rejected).
    old = state.model(e.model_id)
    return [Delete(ModelRow.TABLE, old.key())] if old is not None else []


# --- instances ----------------------------------------------------------------------------


def _drop_runners(state: ClusterState, instance_id: str) -> list[Change]:
    return [Delete(RunnerRow.TABLE, r.key()) for r in state.runners_of(instance_id)]


def _instance_requested(state: ClusterState, e: InstanceRequested) -> list[Change]:
    if state.instance(e.instance_id) is not None:
        return []  # the first request for an id is the one that counts
    row = InstanceRow(
        instance_id=e.instance_id,
        model_id=e.model_id,
        status="requested",
        placement=e.placement,
        replicas=e.replicas,
        context_length=e.context_length,
        requested_at=e.ts,
        role=e.role,
        aliases=list(e.aliases) or None,
        requested_slots=e.slots,
        on_demand=e.on_demand,
        keep_alive_s=e.keep_alive_s,
        reason=e.reason or None,
    )
    return [Put(row)]


def _is_next_decision(old: InstanceRow, generation: int | None) -> bool:
    """A planner's decision counts only for the generation it was made for, so that a late or
    duplicate decision (two planners, a redelivery) never replaces a newer one. Decisions
    without a generation (older logs, hand-written events) always count."""
    return generation is None or generation == old.generation + 1


def _instance_placed(state: ClusterState, e: InstancePlaced) -> list[Change]:
    old = state.instance(e.instance_id) or InstanceRow(
        instance_id=e.instance_id, model_id=e.model_id, status="requested"
    )
    if old.status in INSTANCE_ENDING or not _is_next_decision(old, e.generation):
        return []
    inst = replace(
        old,
        status="placed",
        placed_at=e.ts,
        placements=old.placements + 1,
        reason=e.reason or None,
        needed_bytes=None,
        generation=e.generation if e.generation is not None else old.generation + 1,
        avoid=list(e.avoid) or old.avoid,
        slots=e.slots,
    )
    # A new placement replaces the old shards; a shard it keeps unchanged (same runner, same
    # place, same layers) keeps its runner's state, because that runner keeps running.
    kept = {r.runner_id: r for r in state.runners_of(e.instance_id)}
    changes: list[Change] = [Put(inst)]
    for s in e.shards:
        runner = RunnerRow(
            runner_id=s.runner_id,
            instance_id=e.instance_id,
            node_id=s.node_id,
            device=s.device,
            state="Assigned",
            replica=s.replica,
            rank=s.rank,
            world_size=s.world_size,
            start_layer=s.start_layer,
            end_layer=s.end_layer,
            n_layers=s.n_layers,
            tensor_split=list(s.tensor_split) if s.tensor_split is not None else None,
            devices=[d.model_dump() for d in s.devices] or None,
            updated_at=e.ts,
        )
        before = kept.pop(s.runner_id, None)
        if before is not None and _same_shard(before, runner):
            continue
        changes.append(Put(runner))
    changes += [Delete(RunnerRow.TABLE, r.key()) for r in kept.values()]
    return changes


def _same_shard(a: RunnerRow, b: RunnerRow) -> bool:
    fields = (
        "instance_id",
        "node_id",
        "device",
        "replica",
        "rank",
        "world_size",
        "start_layer",
        "end_layer",
        "n_layers",
        "tensor_split",
        "devices",
    )
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _placement_rejected(state: ClusterState, e: PlacementRejected) -> list[Change]:
    old = state.instance(e.instance_id) or InstanceRow(
        instance_id=e.instance_id, model_id=e.model_id, status="requested"
    )
    if old.status in INSTANCE_ENDING or not _is_next_decision(old, e.generation):
        return []
    inst = replace(
        old,
        status="rejected",
        reason=e.reason,
        needed_bytes=e.needed_bytes,
        generation=e.generation if e.generation is not None else old.generation + 1,
        avoid=list(e.avoid) or old.avoid,
        slots=None,  # no runners, no slots
    )
    return [Put(inst), *_drop_runners(state, e.instance_id)]


def _instance_delete_requested(state: ClusterState, e: InstanceDeleteRequested) -> list[Change]:
    old = state.instance(e.instance_id)
    if old is None or old.status == "deleted":
        return []
    return [Put(replace(old, status="deleting", reason=e.reason or old.reason))]


def _instance_deleted(state: ClusterState, e: InstanceDeleted) -> list[Change]:
    old = state.instance(e.instance_id)
    if old is None:
        return []
    inst = replace(old, status="deleted", deleted_at=e.ts, reason=e.reason or old.reason)
    return [Put(inst), *_drop_runners(state, e.instance_id)]


# --- runners ------------------------------------------------------------------------------


def _runner_state_changed(state: ClusterState, e: RunnerStateChanged) -> list[Change]:
    old = state.runner(e.runner_id)
    if old is None:
        return []  # a runner of a superseded placement or a deleted instance: not current state
    failed = e.state == "Failed"
    row = replace(
        old,
        state=e.state,
        progress=e.progress,
        error=e.error if failed else None,
        exit_code=e.exit_code,
        endpoint=e.endpoint if e.endpoint is not None else old.endpoint,
        pid=e.pid if e.pid is not None else old.pid,
        # Said on Ready; a process started anew (Assigned) has not said it yet.
        slots=e.slots if e.slots is not None else None if e.state == "Assigned" else old.slots,
        failures=old.failures + 1 if failed else old.failures,
        last_failed_at=e.ts if failed else old.last_failed_at,
        failure_times=[*(old.failure_times or []), e.ts.isoformat()][-RECENT_FAILURES:]
        if failed
        else old.failure_times,
        updated_at=e.ts,
    )
    return [Put(row)]


# --- tasks --------------------------------------------------------------------------------


def _task_created(state: ClusterState, e: TaskCreated) -> list[Change]:
    old = state.task(e.task_id)
    if old is not None:
        if e.resume is None or old.status in TASK_ENDED or old.resumes >= e.resume.attempt:
            return []
        # A continuation: waiting for a runner again, as often resumed as it says.
        return [Put(replace(old, status="pending", resumes=e.resume.attempt))]
    row = TaskRow(
        task_id=e.task_id,
        model_id=e.model_id,
        status="pending",
        kind=e.kind,
        user=e.user,
        max_tokens=e.params.max_tokens,
        created_at=e.ts,
        owner=e.owner,
    )
    return [Put(row), *_kept_alive(state, e.model_id, "chat", e.keep_alive_s)]


def _embeddings_requested(state: ClusterState, e: EmbeddingsRequested) -> list[Change]:
    if state.task(e.task_id) is not None:
        return []
    row = TaskRow(
        task_id=e.task_id,
        model_id=e.model_id,
        status="pending",
        kind=e.kind,
        user=e.user,
        created_at=e.ts,
        owner=e.owner,
    )
    return [Put(row), *_kept_alive(state, e.model_id, e.role, e.keep_alive_s)]


def _on_demand_serving(state: ClusterState, model_id: str, role: InstanceRole) -> list[InstanceRow]:
    return [
        i
        for i in state.instances()
        if i.on_demand
        and i.model_id == model_id
        and i.role == role
        and i.status in ("requested", "placed")
    ]


def _kept_alive(
    state: ClusterState, model_id: str, role: InstanceRole, keep_alive_s: float | None
) -> list[Change]:
    """A task that says how long its model stays loaded once idle (Ollama's keep_alive) sets it
    for the on-demand instances serving it; pinned ones stay pinned."""
    if keep_alive_s is None:
        return []
    return [
        Put(replace(i, keep_alive_s=keep_alive_s))
        for i in _on_demand_serving(state, model_id, role)
        if i.keep_alive_s != keep_alive_s
    ]


def _used(state: ClusterState, task: TaskRow, at: datetime) -> list[Change]:
    """A task ended: the on-demand instances of its model and role were used until ``at`` (their
    keep-alive counts from there)."""
    role = role_of_task(task.kind)
    return [
        Put(replace(i, last_used_at=at)) for i in _on_demand_serving(state, task.model_id, role)
    ]


def _task_started(state: ClusterState, e: TaskStarted) -> list[Change]:
    old = state.task(e.task_id)
    if old is None:
        return []
    status = old.status if old.status in TASK_ENDED else "running"
    row = replace(
        old, status=status, started_at=e.ts, runner_id=e.runner_id, instance_id=e.instance_id
    )
    return [Put(row)]


def _superseded(old: TaskRow, e: TaskCompleted | TaskFailed) -> bool:
    """An outcome of an attempt continued since (its runner was stalled, not lost): the task
    goes on with the newer attempt (``resumes`` counts them; bus/attempts.py)."""
    return e.attempt is not None and e.attempt < old.resumes


def _task_completed(state: ClusterState, e: TaskCompleted) -> list[Change]:
    old = state.task(e.task_id)
    if old is None or _superseded(old, e):
        return []
    # A runner that honoured a cancel reports finish_reason "cancelled": keep "cancelled".
    status: TaskStatus = "cancelled" if old.status == "cancelled" else "completed"
    row = replace(
        old,
        status=status,
        finished_at=e.ts,
        runner_id=e.runner_id,
        prompt_tokens=e.usage.prompt_tokens,
        completion_tokens=e.usage.completion_tokens,
        ttft_ms=e.timings.ttft_ms,
        tokens_per_s=e.timings.tokens_per_s,
        total_ms=e.timings.total_ms,
        finish_reason=e.finish_reason,
    )
    changes: list[Change] = [Put(row), *_used(state, old, e.ts)]
    if old.owner is not None and old.status != "completed":  # counted once
        used = state.usage(old.owner, old.model_id) or UsageRow(old.owner, old.model_id)
        used = replace(
            used,
            requests=used.requests + 1,
            prompt_tokens=used.prompt_tokens + e.usage.prompt_tokens,
            cached_tokens=used.cached_tokens + e.usage.cached_tokens,
            completion_tokens=used.completion_tokens + e.usage.completion_tokens,
        )
        changes.append(Put(used))
    return changes


def _task_failed(state: ClusterState, e: TaskFailed) -> list[Change]:
    old = state.task(e.task_id)
    if old is None or old.status in TASK_ENDED or _superseded(old, e):
        return []
    row = replace(
        old,
        status="failed",
        finished_at=e.ts,
        error=e.error,
        runner_id=e.runner_id or old.runner_id,
    )
    return [Put(row), *_used(state, old, e.ts)]


def _task_cancelled(state: ClusterState, e: TaskCancelled) -> list[Change]:
    old = state.task(e.task_id)
    if old is None or old.status in TASK_ENDED:
        return []
    row = replace(old, status="cancelled", finished_at=e.ts, error=e.reason or None)
    return [Put(row), *_used(state, old, e.ts)]


# --- responses ----------------------------------------------------------------------------


def _response_stored(state: ClusterState, e: ResponseStored) -> list[Change]:
    old = state.response(e.response_id)
    if old is not None and old.deleted_at is not None:
        return []  # deleted stays deleted (a background response that ended afterwards)
    row = ResponseRow(
        response_id=e.response_id,
        status=e.status,
        task_id=e.task_id,
        model_id=e.model_id,
        created_at=old.created_at if old is not None else e.ts,
        updated_at=e.ts,
        response=dict(e.response),
        input_items=list(e.input_items),
        conversation=[m.model_dump(mode="json") for m in e.conversation],
        conversation_ref=_dumped(e.conversation_ref),
        input_items_ref=_dumped(e.input_items_ref),
        expires_at=e.expires_at,
        owner=old.owner if old is not None else e.owner,  # whoever made it first
    )
    return [Put(row)]


def _response_deleted(state: ClusterState, e: ResponseDeleted) -> list[Change]:
    old = state.response(e.response_id)
    if old is not None and old.deleted_at is not None:
        return []
    # Only the id, task and times are kept: what was said is gone.
    row = ResponseRow(
        response_id=e.response_id,
        status="deleted",
        task_id=old.task_id if old is not None else "",
        model_id=old.model_id if old is not None else "",
        created_at=old.created_at if old is not None else e.ts,
        updated_at=e.ts,
        deleted_at=e.ts,
        owner=old.owner if old is not None else None,
    )
    return [Put(row)]


# --- API keys -----------------------------------------------------------------------------


def _key_added(state: ClusterState, e: KeyAdded) -> list[Change]:
    if state.api_key(e.key_id) is not None:
        return []  # an id is made once: a key revoked stays revoked
    row = KeyRow(
        key_id=e.key_id,
        name=e.name,
        role=e.role,
        digest=e.digest,
        requests_per_minute=e.requests_per_minute,
        tokens_per_minute=e.tokens_per_minute,
        added_at=e.ts,
    )
    return [Put(row)]


def _key_revoked(state: ClusterState, e: KeyRevoked) -> list[Change]:
    old = state.api_key(e.key_id)
    if old is None or old.revoked_at is not None:
        return []
    return [Put(replace(old, revoked_at=e.ts))]


def _dumped(ref: PartRef | None) -> dict[str, Any] | None:
    return ref.model_dump() if ref is not None else None
