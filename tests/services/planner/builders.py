"""Builders for the planner tests: the events that make a cluster, folded as the projection
folds them, so that every test starts from a state the real system could be in.

Sizes are in whole GiB where it helps: a node offering 10 GiB has 9 GiB usable (90%), one
offering 20 GiB has 18 GiB. Times are seconds after a fixed ``T0``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

from events.catalogue import (
    Event,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    RunnerStateChanged,
)
from events.kinds import Engine
from events.records import Accelerator, AcceleratorBackend, GpuInfo, NodeProfile, ShardAssignment
from events.states import RunnerState
from projectors.rules import fold
from projectors.state import ClusterState
from services.models.footprint import Footprint
from services.planner.cluster import ClusterView, cluster_view, device_layers
from services.planner.decisions import Decision, PlannerPolicy, decide
from services.planner.placement import ModelInfo, Placement, PlacementRequest, Rejection

T0 = datetime(2025, 1, 1, tzinfo=UTC)

# A shard's place in a placement, for comparing whole layouts at once:
# (replica, rank, 'node:device', start_layer, end_layer).
Where = tuple[int, int, str, int, int]


def chat(devices: list[str], **extra: object) -> str:
    """A manual placement spec for the chat role."""
    return json.dumps({"chat": {"devices": devices, **extra}})


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def usable(offered: int) -> int:
    """What placement may use of ``offered`` bytes: 90% of it, exactly."""
    return offered * 9 // 10


# --- events -------------------------------------------------------------------------------


def gpu(index: int, memory: int, name: str = "RTX") -> GpuInfo:
    """An NVIDIA GPU as workers before accelerators reported it (device 'gpuN')."""
    return GpuInfo(index=index, name=name, memory_total=memory, memory_used=0)


def accelerator(
    backend: AcceleratorBackend,
    index: int,
    memory: int,
    *,
    unified: bool = False,
    engines: Sequence[str] = ("llamacpp",),
    name: str = "GPU",
) -> Accelerator:
    return Accelerator(
        backend=backend,
        index=index,
        name=name,
        memory_total=memory,
        memory_free=memory,
        unified=unified,
        engines=list(engines),
    )


def heartbeat(
    node_id: str,
    offered: int,
    *,
    gpus: Sequence[GpuInfo] = (),
    accelerators: Sequence[Accelerator] = (),
    t: float = 0,
) -> ResourceProfiled:
    """A node's profile (also its heartbeat). RAM is twice what it offers: only the offer
    counts for placement."""
    profile = NodeProfile(
        ram_total=2 * offered,
        ram_available=2 * offered,
        cpu_count=8,
        cpu_model="x86",
        memory_offered=offered,
        gpus=list(gpus),
        accelerators=list(accelerators),
    )
    return ResourceProfiled(node_id=node_id, origin=node_id, ts=at(t), profile=profile)


def node(
    node_id: str,
    offered: int,
    *,
    gpus: Sequence[GpuInfo] = (),
    accelerators: Sequence[Accelerator] = (),
    t: float = 0,
    heartbeat_s: float | None = 10.0,
) -> list[Event]:
    """A node joining and sending its first profile."""
    joined = NodeJoined(node_id=node_id, origin=node_id, ts=at(t), heartbeat_s=heartbeat_s)
    return [joined, heartbeat(node_id, offered, gpus=gpus, accelerators=accelerators, t=t)]


def model(
    model_id: str = "m",
    *,
    size: int,
    n_layers: int = 32,
    kv: int = 0,
    overhead: int = 0,
    context_length: int = 0,
    engine: Engine = "llamacpp",
    t: float = 0,
) -> ModelAdded:
    return ModelAdded(
        model_id=model_id,
        origin="cli",
        ts=at(t),
        n_layers=n_layers,
        size_bytes=size,
        kv_bytes_per_token=kv,
        overhead_bytes=overhead,
        context_length=context_length,
        engines=[engine],
    )


def request(
    instance_id: str = "i",
    model_id: str = "m",
    *,
    replicas: int = 1,
    spec: str | None = None,
    context_length: int | None = None,
    slots: int | None = None,
    t: float = 1,
) -> InstanceRequested:
    return InstanceRequested(
        instance_id=instance_id,
        model_id=model_id,
        origin="cli",
        ts=at(t),
        placement=spec,
        replicas=replicas,
        context_length=context_length,
        slots=slots,
    )


def shard(
    runner_id: str,
    node_id: str,
    layers: tuple[int, int],
    n_layers: int,
    *,
    device: str = "cpu",
    replica: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> ShardAssignment:
    return ShardAssignment(
        runner_id=runner_id,
        node_id=node_id,
        device=device,
        replica=replica,
        rank=rank,
        world_size=world_size,
        start_layer=layers[0],
        end_layer=layers[1],
        n_layers=n_layers,
    )


def placed(
    instance_id: str,
    shards: Sequence[ShardAssignment],
    *,
    model_id: str = "m",
    generation: int | None = None,
    slots: int | None = None,
    t: float = 2,
) -> InstancePlaced:
    return InstancePlaced(
        instance_id=instance_id,
        model_id=model_id,
        origin="planner",
        ts=at(t),
        shards=list(shards),
        generation=generation,
        slots=slots,
    )


def runner_state(
    runner_id: str,
    instance_id: str,
    node_id: str,
    state: RunnerState,
    *,
    t: float,
    error: str | None = None,
) -> RunnerStateChanged:
    return RunnerStateChanged(
        runner_id=runner_id,
        instance_id=instance_id,
        node_id=node_id,
        origin=node_id,
        ts=at(t),
        state=state,
        error=error,
    )


def failures(
    runner_id: str, instance_id: str, node_id: str, times: Iterable[float], error: str = "boom"
) -> list[Event]:
    return [
        runner_state(runner_id, instance_id, node_id, "Failed", t=t, error=error) for t in times
    ]


# --- states and views ---------------------------------------------------------------------


def fold_all(*groups: Event | Sequence[Event], state: ClusterState | None = None) -> ClusterState:
    """Fold events (single ones or lists of them, in order) into ``state`` or a new one."""
    events: list[Event] = []
    for group in groups:
        events.extend(group if isinstance(group, Sequence) else [group])
    return fold(events, state)


def view(*groups: Event | Sequence[Event], excluding: str | None = None) -> ClusterView:
    return cluster_view(fold_all(*groups), excluding_instance=excluding)


def usable_of(cluster: ClusterView) -> dict[str, int]:
    return {ref: d.usable for ref, d in sorted(cluster.devices.items())}


# --- placement requests and results -------------------------------------------------------


def info(added: ModelAdded) -> ModelInfo:
    footprint = Footprint(
        n_layers=added.n_layers,
        weights_bytes=added.size_bytes,
        kv_bytes_per_token=added.kv_bytes_per_token,
        overhead_bytes=added.overhead_bytes,
    )
    return ModelInfo(added.model_id, footprint, added.context_length, added.engines[0])


def ask(
    added: ModelAdded | None,
    *,
    instance_id: str = "i",
    replicas: int = 1,
    spec: str | None = None,
    context_length: int | None = None,
    generation: int = 1,
    avoid: Iterable[str] = (),
    current: Sequence[ShardAssignment] = (),
    slots: int | None = 1,
    current_slots: int | None = None,
) -> PlacementRequest:
    """A request; for one slot unless told (``slots=None``: as many as fit)."""
    return PlacementRequest(
        instance_id=instance_id,
        model=info(added) if added is not None else None,
        replicas=replicas,
        context_length=context_length,
        spec=spec,
        generation=generation,
        avoid=frozenset(avoid),
        current=tuple(current),
        slots=slots,
        current_slots=current_slots,
    )


def placement(result: Placement | Rejection) -> Placement:
    assert isinstance(result, Placement), f"expected a placement, got {result}"
    return result


def rejection(result: Placement | Rejection) -> Rejection:
    assert isinstance(result, Rejection), f"expected a rejection, got {result}"
    return result


def parts(shard: ShardAssignment) -> list[tuple[str, int]]:
    """The devices of a shard's node and the layers each holds, in layer order."""
    return device_layers(shard)


def layout(shards: Iterable[ShardAssignment]) -> list[Where]:
    """Where each shard runs, in replica and rank order."""
    return sorted(
        (s.replica, s.rank, f"{s.node_id}:{s.device}", s.start_layer, s.end_layer) for s in shards
    )


# --- deciding -----------------------------------------------------------------------------

POLICY = PlannerPolicy()


def settle(state: ClusterState, now: float, policy: PlannerPolicy = POLICY) -> list[Decision]:
    """One planner round at ``now``: decide, then fold the decisions into ``state`` as the
    projection would once they are published."""
    decisions = decide(state, at(now), policy)
    fold([d.event for d in decisions], state)
    return decisions
