"""Instances and their runners: requested, placed or rejected (one planner decision per
generation), deleted; and each runner's reported state."""

from __future__ import annotations

from dataclasses import replace

from events.catalogue import (
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    PlacementRejected,
    RunnerStateChanged,
)
from events.states import INSTANCE_ENDING
from projectors.rows import (
    InstanceRow,
    RunnerRow,
)
from projectors.state import Change, ClusterState, Delete, Put

RECENT_FAILURES = 10  # failure times kept per runner, for the planner's "fails too often"


def _drop_runners(state: ClusterState, instance_id: str) -> list[Change]:
    return [Delete(RunnerRow.TABLE, r.key()) for r in state.runners_of(instance_id)]


def instance_requested(state: ClusterState, e: InstanceRequested) -> list[Change]:
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
        requested_kv_cache=e.kv_cache,
        speculative=e.speculative.model_dump() if e.speculative is not None else None,
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


def instance_placed(state: ClusterState, e: InstancePlaced) -> list[Change]:
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
        kv_cache=e.kv_cache,
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


def placement_rejected(state: ClusterState, e: PlacementRejected) -> list[Change]:
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


def instance_delete_requested(state: ClusterState, e: InstanceDeleteRequested) -> list[Change]:
    old = state.instance(e.instance_id)
    if old is None or old.status == "deleted":
        return []
    return [Put(replace(old, status="deleting", reason=e.reason or old.reason))]


def instance_deleted(state: ClusterState, e: InstanceDeleted) -> list[Change]:
    old = state.instance(e.instance_id)
    if old is None:
        return []
    inst = replace(old, status="deleted", deleted_at=e.ts, reason=e.reason or old.reason)
    return [Put(inst), *_drop_runners(state, e.instance_id)]


def runner_state_changed(state: ClusterState, e: RunnerStateChanged) -> list[Change]:
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
