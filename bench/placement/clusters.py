"""The clusters ``bench.placement`` times placement on: the models (Llama sizes, and one that
fits nowhere), a cluster's nodes drawn with a fixed seed, instances already placed on them, the
requests a ``decide`` round places, all folded into a ``ClusterState`` as the projection folds
the log. The bench's own docstring says what each is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from events.records import Accelerator, NodeProfile, ShardAssignment
from events.units import GiB, MiB
from projectors.rules import fold
from projectors.state import ClusterState
from services.models.footprint import Footprint, context_for
from services.planner.cluster import ClusterView, cluster_view
from services.planner.placement import ModelInfo

TiB = 1024**4
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def kv_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """K and V, f16, for every layer."""
    return 2 * layers * kv_heads * head_dim * 2


def model_added(
    model_id: str, size: int, n_layers: int, kv: int, overhead: int, context: int = 131_072
) -> ModelAdded:
    return ModelAdded(
        model_id=model_id,
        origin="cli",
        ts=T0,
        family="llama",
        n_layers=n_layers,
        size_bytes=size,
        kv_bytes_per_token=kv,
        overhead_bytes=overhead,
        context_length=context,
    )


LLAMA_1B = model_added("llama-3.2-1b", 808 * MiB, 16, kv_per_token(16, 8, 64), 256 * MiB)
LLAMA_3B = model_added("llama-3.2-3b", 1925 * MiB, 28, kv_per_token(28, 8, 128), 384 * MiB)
LLAMA_8B = model_added("llama-3.1-8b", 4813 * MiB, 32, kv_per_token(32, 8, 128), 512 * MiB)
LLAMA_70B = model_added("llama-3.1-70b", 40 * GiB, 80, kv_per_token(80, 8, 128), 1 * GiB)
LLAMA_405B = model_added("llama-3.1-405b", 230 * GiB, 126, kv_per_token(126, 8, 128), 2 * GiB)
TOO_BIG = model_added("too-big-16t", 16 * TiB, 126, kv_per_token(126, 16, 128), 4 * GiB)
MODELS = (LLAMA_1B, LLAMA_3B, LLAMA_8B, LLAMA_70B, LLAMA_405B, TOO_BIG)
BACKGROUND_MODELS = (LLAMA_1B, LLAMA_3B, LLAMA_8B)
# The requests a decide round places: (model, replicas).
PENDING: tuple[tuple[ModelAdded, int], ...] = (
    (LLAMA_8B, 1),
    (LLAMA_8B, 3),
    (LLAMA_70B, 1),
    (LLAMA_405B, 1),
    (LLAMA_3B, 2),
    (LLAMA_1B, 1),
    (LLAMA_8B, 1),
    (LLAMA_70B, 2),
    (LLAMA_3B, 1),
    (LLAMA_8B, 2),
)


def info(added: ModelAdded) -> ModelInfo:
    fp = Footprint(
        n_layers=added.n_layers,
        weights_bytes=added.size_bytes,
        kv_bytes_per_token=added.kv_bytes_per_token,
        overhead_bytes=added.overhead_bytes,
    )
    return ModelInfo(added.model_id, fp, added.context_length)


def need_of(added: ModelAdded, layers: int | None = None) -> int:
    ctx = context_for(added.context_length, None)
    return info(added).footprint.need_bytes(ctx, layers)


# --- clusters -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    memory_gib: tuple[int, int]  # memory_offered, drawn uniformly (whole GiB)
    gpu_gib: tuple[int, ...]  # the GPU sizes a node may have
    max_gpus: int


MIXED = Shape("mixed", (8, 128), (8, 12, 16, 24, 40, 48, 80), 4)
SMALL = Shape("small", (8, 32), (8, 12, 16, 24), 2)


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    offered: int
    gpus: tuple[int, ...]  # memory of each GPU


def draw_nodes(shape: Shape, n: int, seed: int) -> list[NodeSpec]:
    rng = random.Random(f"{seed}:{shape.name}:{n}")
    nodes = []
    for i in range(n):
        offered = rng.randint(*shape.memory_gib) * GiB
        gpus: tuple[int, ...] = ()
        if i % 4 == 3:
            gpus = (rng.choice(shape.gpu_gib) * GiB,) * rng.randint(1, shape.max_gpus)
        nodes.append(NodeSpec(f"{shape.name}-{i:04d}", offered, gpus))
    return nodes


def node_events(spec: NodeSpec) -> list[Event]:
    joined = NodeJoined(node_id=spec.node_id, origin=spec.node_id, ts=T0, heartbeat_s=10.0)
    profile = NodeProfile(
        ram_total=spec.offered + 8 * GiB,
        ram_available=spec.offered + 4 * GiB,
        cpu_count=16,
        cpu_model="x86_64",
        memory_offered=spec.offered,
        accelerators=[
            Accelerator(
                backend="cuda",
                index=g,
                name=f"GPU {m // GiB} GiB",
                memory_total=m,
                memory_free=m,
                engines=["llamacpp"],
            )
            for g, m in enumerate(spec.gpus)
        ],
    )
    profiled = ResourceProfiled(node_id=spec.node_id, origin=spec.node_id, ts=T0, profile=profile)
    return [joined, profiled]


def shard(
    runner_id: str, node_id: str, device: str, layers: tuple[int, int], n_layers: int, rank: int
) -> ShardAssignment:
    return ShardAssignment(
        runner_id=runner_id,
        node_id=node_id,
        device=device,
        rank=rank,
        world_size=2 if layers != (0, n_layers) else 1,
        start_layer=layers[0],
        end_layer=layers[1],
        n_layers=n_layers,
    )


def background_events(nodes: Sequence[NodeSpec]) -> list[Event]:
    """N/2 placed instances: instance i on node 2i (or on nodes 2i and 2i+1, half the layers
    each, for every fifth), all runners Ready."""
    events: list[Event] = []
    for i in range(len(nodes) // 2):
        iid = f"bg-{i:04d}"
        m = BACKGROUND_MODELS[i % len(BACKGROUND_MODELS)]
        a, b = nodes[2 * i], nodes[2 * i + 1]
        n = m.n_layers
        half = n // 2
        if i % 5 == 4:
            shards = [
                shard(f"{iid}-g1-r0-s0", a.node_id, "cpu", (0, half), n, 0),
                shard(f"{iid}-g1-r0-s1", b.node_id, "cpu", (half, n), n, 1),
            ]
        else:
            on_gpu = bool(a.gpus) and need_of(m) <= a.gpus[0] * 9 // 10
            device = "cuda0" if on_gpu else "cpu"
            shards = [shard(f"{iid}-g1-r0-s0", a.node_id, device, (0, n), n, 0)]
        events.append(
            InstanceRequested(instance_id=iid, model_id=m.model_id, origin="cli", ts=at(1))
        )
        events.append(
            InstancePlaced(
                instance_id=iid,
                model_id=m.model_id,
                origin="planner",
                ts=at(2),
                shards=shards,
                generation=1,
            )
        )
        events += [
            RunnerStateChanged(
                runner_id=s.runner_id,
                instance_id=iid,
                node_id=s.node_id,
                origin=s.node_id,
                ts=at(3),
                state="Ready",
                endpoint=f"{s.node_id}:50051",
            )
            for s in shards
        ]
    return events


def build_state(shape: Shape, n: int, seed: int) -> ClusterState:
    nodes = draw_nodes(shape, n, seed)
    events: list[Event] = [e for spec in nodes for e in node_events(spec)]
    events += MODELS
    events += background_events(nodes)
    return fold(events)


def pending_events() -> list[Event]:
    return [
        InstanceRequested(
            instance_id=f"new-{k:02d}",
            model_id=m.model_id,
            origin="cli",
            ts=at(4 + k / 10),
            replicas=replicas,
        )
        for k, (m, replicas) in enumerate(PENDING)
    ]


@dataclass
class Cluster:
    nodes: int
    state: ClusterState  # the mixed cluster
    view: ClusterView
    small: ClusterView  # the small-node cluster's view
    pending: ClusterState  # the mixed cluster with the PENDING requests
    build_s: float


def build_cluster(n: int, seed: int) -> Cluster:
    t0 = time.perf_counter()
    state = build_state(MIXED, n, seed)
    small_state = build_state(SMALL, n, seed)
    pending = fold(pending_events(), state.copy())
    return Cluster(
        n,
        state,
        cluster_view(state),
        cluster_view(small_state),
        pending,
        time.perf_counter() - t0,
    )


def describe(view: ClusterView, state: ClusterState | None = None) -> str:
    gpus = sum(d.kind == "gpu" for d in view.devices.values())
    usable = sum(max(d.usable, 0) for d in view.devices.values())
    reserved = sum(d.reserved for d in view.devices.values())
    text = (
        f"{len(view.node_status):,} nodes, {len(view.devices):,} devices ({gpus:,} GPUs), "
        f"{usable / TiB:.1f} TiB usable, {reserved / GiB:,.0f} GiB reserved"
    )
    if state is not None:
        runners = len(state.tables["runners"])
        text += f" by {len(state.instances()):,} instances / {runners:,} runners"
    return text
