"""Placement speed: ``place`` alone, with ``cluster_view``, and a whole ``decide`` round.

    .venv/bin/python -m bench.placement [--nodes 10,100,1000] [--budget 1.0] [--seed 1]
                                         [--cases fit-8b,decide-10] [--no-gc] [--profile CASE]

Everything is in this process and pure: no NATS, no database. For every cluster size N the
state is built as the projection builds it, by folding real events with
``projectors.rules.fold`` (untimed):

- N nodes (``NodeJoined`` + ``ResourceProfiled``) offering 8-128 GiB of RAM each, drawn at
  random with a fixed seed; every fourth node also has 1-4 identical GPUs of 8-80 GiB;
- the models (``ModelAdded``, Q4_K_M sizes; KV bytes per token from each model's layers, KV
  heads and head size at f16): Llama 3.2 1B (0.79 GiB, 16 layers), 3.2 3B (1.88 GiB, 28),
  3.1 8B (4.7 GiB, 32), 3.1 70B (40 GiB, 80), 3.1 405B (230 GiB, 126), and a made-up
  16 TiB model of 126 layers that no cluster here can hold;
- N/2 instances already placed (``InstanceRequested`` + ``InstancePlaced`` + a ``Ready``
  ``RunnerStateChanged`` per runner) of the 1B, 3B and 8B models, one per node on every other
  node (its first GPU when it fits there, else its RAM), every fifth of them split over two
  nodes, so that ``cluster_view`` has reservations to count.

A second cluster of N smallish nodes (8-32 GiB, every fourth with 1-2 GPUs of 8-24 GiB), built
the same way, is where the 70B model cannot fit one device and has to be split.

The cases (all requests at the default context, 2048 tokens):

- place only, on a ``ClusterView`` built beforehand:
  ``fit-8b`` (auto, one device), ``split-70b`` (auto, split on the small cluster),
  ``split-405b`` (auto, split over the biggest nodes), ``replicas-3`` (auto, the 8B three
  times), ``manual-split`` (the 70B on the two roomiest devices, ``tensor_split`` [3, 1]),
  ``manual-replicas`` (the 70B, 2 replicas over 4 devices, ``tensor_split`` [3, 1, 3, 1]),
  ``reject`` (the 16 TiB model: one of its layers is more than any device has, so the split
  gives up at the first node; what is timed is the scan, the sort and the wording of the
  rejection, with the room of every device, as the planner words it);
- ``view``: ``cluster_view(state)`` alone, to show what the next two add;
- ``view+place-8b`` and ``view+place-405b``: ``cluster_view(state, excluding_instance=...)``
  then ``place``, the cost of placing one instance from a fresh view (a round builds the view once);
- ``decide-10``: a whole ``decide(state, now, policy)`` round over the state with 10 more
  instances requested (8B, 70B, 405B, 1B and 3B, some with replicas), all of which it places.

Each case is called once and its result checked, warmed up, then called repeatedly, every call
timed on its own with ``time.perf_counter_ns``, for ``--budget`` seconds (at least
``--min-reps`` calls, at most ``--max-reps``); the median and the 95th percentile (nearest
rank) are reported. The result of the last timed call is checked again. The checks make sure
the intended path was timed: a ``Placement`` on the expected device (a GPU when one fits,
else the roomiest), a split over exactly the fewest nodes whose room holds the model (computed
here, independently), three replicas on three nodes, the manual layers where the spec puts
them, a ``Rejection`` saying the model is too big, ``decide`` placing all 10 requests. A failed
check stops the bench.

The garbage collector is left as Python sets it (enabled, default thresholds); it is run once
before each case so that no case collects another's garbage, and the table counts the
collections of each generation during a case's timed calls. ``--no-gc`` disables it during the
timed calls instead, to see how much of the tail is the collector's.

Target (issue): placing takes at most 20 ms on a 1,000-node cluster. The verdict is on the 95th
percentile of the place-only cases at 1,000 nodes; ``cluster_view`` + ``place`` and ``decide``
are shown against the same 20 ms for scale. The exit status is 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from bench.common.report import print_head, print_profile
from bus.events import (
    Event,
    GpuInfo,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    NodeProfile,
    ResourceProfiled,
    RunnerStateChanged,
    ShardAssignment,
)
from projectors.rules import fold
from projectors.state import ClusterState
from services.models.footprint import Footprint, context_for
from services.planner.cluster import ClusterView, Device, cluster_view
from services.planner.decisions import Decision, PlannerPolicy, decide
from services.planner.placement import ModelInfo, Placement, PlacementRequest, Rejection, place

MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
TARGET_MS = 20.0
TARGET_NODES = 1000
T0 = datetime(2025, 1, 1, tzinfo=UTC)
NOW = T0 + timedelta(seconds=10)  # one heartbeat interval after the profiles: no time-outs
POLICY = PlannerPolicy()


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
        gpus=[
            GpuInfo(index=g, name=f"GPU {m // GiB} GiB", memory_total=m, memory_used=0)
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
            device = "gpu0" if on_gpu else "cpu"
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


# --- checks ---------------------------------------------------------------------------------


class CheckFailed(AssertionError):
    """A measured call did not return what the case is meant to time."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def a_placement(result: object) -> Placement:
    if isinstance(result, Rejection):
        raise CheckFailed(f"expected a placement, got a rejection: {result.reason}")
    require(isinstance(result, Placement), f"expected a placement, got {result!r}")
    assert isinstance(result, Placement)
    return result


def ref(s: ShardAssignment) -> str:
    return f"{s.node_id}:{s.device}"


def check_layers(p: Placement, n_layers: int) -> None:
    """Every replica's shards cover the layers once, in rank order."""
    by_replica: dict[int, list[ShardAssignment]] = {}
    for s in p.shards:
        by_replica.setdefault(s.replica, []).append(s)
    for replica, shards in by_replica.items():
        shards.sort(key=lambda s: s.rank)
        start = 0
        for s in shards:
            require(s.start_layer == start, f"replica {replica}: a gap or overlap at {start}")
            require(s.end_layer > s.start_layer, f"replica {replica}: an empty shard")
            require(s.world_size == len(shards), f"replica {replica}: wrong world_size")
            start = s.end_layer
        require(start == n_layers, f"replica {replica}: {start} of {n_layers} layers placed")


def expected_device(view: ClusterView, need: int) -> Device:
    """Where one-device placement should go: a GPU when one fits, else the most room."""
    fitting = [d for d in view.devices.values() if d.usable >= need]
    require(bool(fitting), "no device fits: the case would not time a one-device placement")
    return min(fitting, key=lambda d: (d.kind != "gpu", -d.usable, d.ref))


def fewest_nodes(view: ClusterView, added: ModelAdded) -> int:
    """The fewest nodes (their roomiest device each) whose room for layers, less one engine
    overhead each, adds up to the model's weights and KV cache."""
    overhead = added.overhead_bytes
    body = need_of(added) - overhead
    best: dict[str, int] = {}
    for d in view.devices.values():
        best[d.node_id] = max(best.get(d.node_id, d.usable), d.usable)
    room = 0
    for k, usable in enumerate(sorted(best.values(), reverse=True), start=1):
        room += usable - overhead
        if k >= 2 and room >= body:
            return k
    raise CheckFailed(f"{added.model_id} cannot be split over this cluster")


Check = Callable[[object], str]


def fit_check(view: ClusterView, added: ModelAdded) -> Check:
    expected = expected_device(view, need_of(added))

    def check(result: object) -> str:
        p = a_placement(result)
        require(len(p.shards) == 1, f"expected one shard, got {len(p.shards)}")
        require(ref(p.shards[0]) == expected.ref, f"on {ref(p.shards[0])}, not {expected.ref}")
        check_layers(p, added.n_layers)
        return f"1 {expected.kind} device"

    return check


def split_check(view: ClusterView, added: ModelAdded) -> Check:
    require(
        not any(d.usable >= need_of(added) for d in view.devices.values()),
        f"{added.model_id} fits one device: the case would not time a split",
    )
    k = fewest_nodes(view, added)

    def check(result: object) -> str:
        p = a_placement(result)
        nodes = {s.node_id for s in p.shards}
        require(len(p.shards) == k, f"split over {len(p.shards)} shards, expected {k}")
        require(len(nodes) == k, f"split over {len(nodes)} nodes, expected {k}")
        check_layers(p, added.n_layers)
        for s in p.shards:
            share = need_of(added, s.end_layer - s.start_layer)
            require(share <= view.devices[ref(s)].usable, f"{ref(s)} cannot hold its share")
        return f"split, {k} nodes"

    return check


def replicas_check(added: ModelAdded, replicas: int) -> Check:
    def check(result: object) -> str:
        p = a_placement(result)
        require(len(p.shards) == replicas, f"{len(p.shards)} shards, expected {replicas}")
        require({s.replica for s in p.shards} == set(range(replicas)), "replicas missing")
        nodes = {s.node_id for s in p.shards}
        require(len(nodes) == replicas, f"replicas share nodes: {sorted(nodes)}")
        check_layers(p, added.n_layers)
        return f"{replicas} replicas, {replicas} nodes"

    return check


def manual_check(added: ModelAdded, expected: list[tuple[int, str, int]]) -> Check:
    """``expected``: (replica, 'node:device', layers) in replica and rank order."""

    def check(result: object) -> str:
        p = a_placement(result)
        got = [
            (s.replica, ref(s), s.end_layer - s.start_layer)
            for s in sorted(p.shards, key=lambda s: (s.replica, s.rank))
        ]
        require(got == expected, f"placed {got}, expected {expected}")
        check_layers(p, added.n_layers)
        replicas = len({r for r, _, _ in expected})
        layers = "+".join(str(n) for r, _, n in expected if r == 0)
        return f"{replicas} x {len(expected) // replicas} devices ({layers})"

    return check


def reject_check(added: ModelAdded) -> Check:
    need = need_of(added)

    def check(result: object) -> str:
        require(isinstance(result, Rejection), f"expected a rejection, got {result!r}")
        assert isinstance(result, Rejection)
        require(result.needed_bytes == need, f"needed_bytes {result.needed_bytes} != {need}")
        require("more than any device or set of nodes" in result.reason, result.reason)
        return "rejected"

    return check


def view_check(expected: ClusterView) -> Check:
    def check(result: object) -> str:
        require(isinstance(result, ClusterView), f"expected a ClusterView, got {result!r}")
        assert isinstance(result, ClusterView)
        require(dict(result.devices) == dict(expected.devices), "a different view")
        reserved = sum(1 for d in result.devices.values() if d.reserved)
        return f"{len(result.devices):,} devices, {reserved:,} reserved"

    return check


def decide_check() -> Check:
    wanted = {f"new-{k:02d}": (m, r) for k, (m, r) in enumerate(PENDING)}

    def check(result: object) -> str:
        require(isinstance(result, list), f"expected decisions, got {result!r}")
        assert isinstance(result, list)
        decisions: list[Decision] = result
        events = [d.event for d in decisions]
        kinds = sorted({type(e).__name__ for e in events})
        require(all(isinstance(e, InstancePlaced) for e in events), f"decided {kinds}")
        placed = [e for e in events if isinstance(e, InstancePlaced)]
        require(sorted(e.instance_id for e in placed) == sorted(wanted), "not the 10 requests")
        splits = 0
        for e in placed:
            m, replicas = wanted[e.instance_id]
            require({s.replica for s in e.shards} == set(range(replicas)), "replicas missing")
            require(all(s.n_layers == m.n_layers for s in e.shards), "wrong model")
            split = any(s.world_size > 1 for s in e.shards)
            require(split or m is not LLAMA_405B, "the 405B was not split")
            splits += split
        return f"{len(placed)} placed ({splits} split)"

    return check


# --- cases ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "place" (the target applies), "view", "view+place", "decide"
    call: Callable[[], object]
    check: Check


CASE_NAMES = (
    "fit-8b",
    "split-70b",
    "split-405b",
    "replicas-3",
    "manual-split",
    "manual-replicas",
    "reject",
    "view",
    "view+place-8b",
    "view+place-405b",
    "decide-10",
)


def roomiest(view: ClusterView, count: int) -> list[Device]:
    return sorted(view.devices.values(), key=lambda d: (-d.usable, d.ref))[:count]


def ask(
    added: ModelAdded, instance_id: str = "new", replicas: int = 1, spec: str | None = None
) -> PlacementRequest:
    return PlacementRequest(instance_id, info(added), replicas=replicas, spec=spec)


def cases_for(c: Cluster) -> list[Case]:
    v, small = c.view, c.small
    n70 = LLAMA_70B.n_layers
    big, second = (n70 * 3 // 4, n70 - n70 * 3 // 4)  # tensor_split [3, 1]

    d = roomiest(v, 2)
    two = json.dumps({"chat": {"devices": [x.ref for x in d], "tensor_split": [3, 1]}})
    two_expected = [(0, d[0].ref, big), (0, d[1].ref, second)]

    r = roomiest(v, 4)
    four = [r[0], r[3], r[1], r[2]]  # the two roomiest take the larger shares
    spec = {"devices": [x.ref for x in four], "tensor_split": [3, 1, 3, 1], "replicas": 2}
    four_expected = [
        (0, four[0].ref, big),
        (0, four[1].ref, second),
        (1, four[2].ref, big),
        (1, four[3].ref, second),
    ]

    # Requests are made here, so that the timed calls are place() and nothing else.
    fit8, split70, split405 = ask(LLAMA_8B), ask(LLAMA_70B), ask(LLAMA_405B)
    three = ask(LLAMA_8B, replicas=3)
    manual2 = ask(LLAMA_70B, spec=two)
    manual4 = ask(LLAMA_70B, spec=json.dumps({"chat": spec}))
    too_big = ask(TOO_BIG)

    state = c.state
    v8 = cluster_view(state, excluding_instance="new-8b")
    v405 = cluster_view(state, excluding_instance="new-405b")
    req8 = ask(LLAMA_8B, "new-8b")
    req405 = ask(LLAMA_405B, "new-405b")
    return [
        Case("fit-8b", "place", lambda: place(v, fit8), fit_check(v, LLAMA_8B)),
        Case("split-70b", "place", lambda: place(small, split70), split_check(small, LLAMA_70B)),
        Case("split-405b", "place", lambda: place(v, split405), split_check(v, LLAMA_405B)),
        Case("replicas-3", "place", lambda: place(v, three), replicas_check(LLAMA_8B, 3)),
        Case(
            "manual-split",
            "place",
            lambda: place(v, manual2),
            manual_check(LLAMA_70B, two_expected),
        ),
        Case(
            "manual-replicas",
            "place",
            lambda: place(v, manual4),
            manual_check(LLAMA_70B, four_expected),
        ),
        Case("reject", "place", lambda: place(v, too_big), reject_check(TOO_BIG)),
        Case("view", "view", lambda: cluster_view(state), view_check(v)),
        Case(
            "view+place-8b",
            "view+place",
            lambda: place(cluster_view(state, excluding_instance="new-8b"), req8),
            fit_check(v8, LLAMA_8B),
        ),
        Case(
            "view+place-405b",
            "view+place",
            lambda: place(cluster_view(state, excluding_instance="new-405b"), req405),
            split_check(v405, LLAMA_405B),
        ),
        Case(
            "decide-10",
            "decide",
            lambda: decide(c.pending, NOW, POLICY),
            decide_check(),
        ),
    ]


# --- measuring ------------------------------------------------------------------------------


@dataclass
class Result:
    """One case's figures. It keeps the case's name, not the case, so that a cluster is freed
    once its cases are measured and the next cluster's collections do not traverse it."""

    name: str
    kind: str
    nodes: int
    samples_ns: list[int] = field(default_factory=list)
    outcome: str = ""
    gcs: tuple[int, ...] = ()  # collections of each generation during the timed calls

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ns) / 1e6

    @property
    def p95_ms(self) -> float:
        ordered = sorted(self.samples_ns)
        return ordered[math.ceil(0.95 * len(ordered)) - 1] / 1e6


def measure(case: Case, nodes: int, args: argparse.Namespace) -> Result:
    clock = time.perf_counter_ns
    try:
        outcome = case.check(case.call())
    except CheckFailed as exc:
        raise SystemExit(f"check FAILED, {case.name} at {nodes} nodes: {exc}") from None
    warm_until = clock() + int(args.budget * 0.1e9)
    calls = 0
    while calls < 3 or clock() < warm_until:
        case.call()
        calls += 1
    gc.collect()
    samples: list[int] = []
    result: object = None
    before = [g["collections"] for g in gc.get_stats()]
    if args.no_gc:
        gc.disable()
    try:
        deadline = clock() + int(args.budget * 1e9)
        while len(samples) < args.max_reps and (len(samples) < args.min_reps or clock() < deadline):
            t0 = clock()
            result = case.call()
            samples.append(clock() - t0)
        after = [g["collections"] for g in gc.get_stats()]  # before enable() can collect
    finally:
        gc.enable()
    gcs = tuple(a - b for a, b in zip(after, before, strict=True))
    try:
        last = case.check(result)
    except CheckFailed as exc:
        raise SystemExit(f"check FAILED, {case.name} at {nodes} nodes (timed): {exc}") from None
    if last != outcome:
        raise SystemExit(f"check FAILED, {case.name}: the timed calls gave {last}, not {outcome}")
    return Result(case.name, case.kind, nodes, samples, outcome, gcs)


# --- report ---------------------------------------------------------------------------------


def target_applies(r: Result) -> bool:
    return r.kind == "place" and r.nodes == TARGET_NODES


def print_table(results: list[Result]) -> None:
    header = (
        f"{'case':<16} {'nodes':>6} {'reps':>6} {'median ms':>10} {'p95 ms':>8} "
        f"{'median/target':>17} {'p95/target':>10} {'':>4} {'gc 0/1/2':>10}  result"
    )
    print_head(header, rule=18)
    last = ""
    for r in sorted(results, key=lambda r: (CASE_NAMES.index(r.name), r.nodes)):
        if last and r.name != last:
            print()
        last = r.name
        verdict = ""
        if target_applies(r):
            verdict = "ok" if r.p95_ms <= TARGET_MS else "MISS"
        median_ratio = f"{r.median_ms / TARGET_MS:.3f}x of target"
        p95_ratio = f"{r.p95_ms / TARGET_MS:.3f}x"
        gcs = "/".join(str(n) for n in r.gcs)
        print(
            f"{r.name:<16} {r.nodes:>6,} {len(r.samples_ns):>6,} {r.median_ms:>10.3f} "
            f"{r.p95_ms:>8.3f} {median_ratio:>17} {p95_ratio:>10} {verdict:>4} {gcs:>10}  "
            f"{r.outcome}"
        )


def print_verdict(results: list[Result]) -> bool:
    judged = [r for r in results if target_applies(r)]
    print()
    if not judged:
        print(
            f"target not checked: it is for place at {TARGET_NODES:,} nodes, which was not run "
            f"(--nodes)"
        )
        return True
    worst = max(judged, key=lambda r: r.p95_ms)
    missed = [r for r in judged if r.p95_ms > TARGET_MS]
    if missed:
        names = ", ".join(f"{r.name} ({r.p95_ms:.2f} ms)" for r in missed)
        print(f"TARGET MISSED: place at {TARGET_NODES:,} nodes takes more than {TARGET_MS:g} ms")
        print(f"  at p95 in: {names}")
    else:
        print(
            f"target HOLDS: place at {TARGET_NODES:,} nodes <= {TARGET_MS:g} ms in every case "
            f"(p95); slowest {worst.name}: median {worst.median_ms:.2f} ms, p95 "
            f"{worst.p95_ms:.2f} ms = {worst.p95_ms / TARGET_MS:.2f}x of target"
        )
    for kind in ("view+place", "decide"):
        rows = [r for r in results if r.kind == kind and r.nodes == TARGET_NODES]
        if rows:
            slow = max(rows, key=lambda r: r.p95_ms)
            over = "over" if slow.p95_ms > TARGET_MS else "within"
            print(
                f"  for scale, {kind} at {TARGET_NODES:,} nodes: slowest {slow.name}, p95 "
                f"{slow.p95_ms:.2f} ms ({slow.p95_ms / TARGET_MS:.2f}x, {over} 20 ms; not "
                f"the target's)"
            )
    return not missed


def print_scaling(results: list[Result]) -> None:
    sizes = sorted({r.nodes for r in results})
    if len(sizes) < 2:
        return
    lo, hi = sizes[0], sizes[-1]
    by = {(r.name, r.nodes): r for r in results}
    parts = []
    for name in CASE_NAMES:
        a, b = by.get((name, lo)), by.get((name, hi))
        if a is not None and b is not None:
            parts.append(f"{name} {b.median_ms / a.median_ms:.0f}x")
    print(f"\nmedian at {hi:,} nodes / at {lo:,} ({hi // lo}x the nodes): " + ", ".join(parts))


def profile(case: Case, reps: int, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        case.call()
    profiler.disable()
    print_profile(profiler, f"{case.name}, {reps} calls", top)


# --- main -----------------------------------------------------------------------------------


def load() -> str:
    """Other processes slow these single-threaded figures down: the 1-minute load says so."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", default="10,100,1000", help="cluster sizes, comma-separated")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls a case")
    parser.add_argument("--min-reps", type=int, default=30, help="timed calls a case, at least")
    parser.add_argument("--max-reps", type=int, default=3000, help="timed calls a case, at most")
    parser.add_argument("--seed", type=int, default=1, help="for the node sizes")
    parser.add_argument(
        "--cases",
        default=",".join(CASE_NAMES),
        help="comma-separated, of: " + ", ".join(CASE_NAMES),
    )
    parser.add_argument(
        "--profile", choices=CASE_NAMES, help="also profile this case at the largest size"
    )
    parser.add_argument(
        "--no-gc",
        action="store_true",
        help="disable the collector during the timed calls (default: as Python sets it)",
    )
    parser.add_argument("--profile-reps", type=int, default=200, help="calls to profile")
    parser.add_argument("--profile-top", type=int, default=25, help="profile lines to print")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(n) for n in parse_list(args.nodes)})
    except ValueError:
        parser.error("--nodes takes whole numbers, e.g. 10,100,1000")
    if not sizes or sizes[0] < 10:
        parser.error("--nodes: at least one size, each at least 10 nodes")
    names = parse_list(args.cases)
    unknown = [n for n in names if n not in CASE_NAMES]
    if unknown or not names:
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(CASE_NAMES)}")
    if args.budget <= 0 or args.min_reps < 1 or args.max_reps < args.min_reps:
        parser.error("--budget must be > 0 and 1 <= --min-reps <= --max-reps")

    started = time.perf_counter()
    print(
        f"placement speed: Python {sys.version.split()[0]} on {os.cpu_count()} cpus "
        f"(load average {load()}), seed {args.seed}, "
        f"{args.budget:g} s of timed calls a case ({args.min_reps}-{args.max_reps} calls), "
        f"context {context_for(0, None)} tokens"
    )
    if args.no_gc:
        print("gc: DISABLED during the timed calls (--no-gc); collected before each case")
    else:
        print(
            f"gc: Python default, {'enabled' if gc.isenabled() else 'DISABLED'}, thresholds "
            f"{gc.get_threshold()}; collected before each case"
        )
    results: list[Result] = []
    largest: Cluster | None = None
    for n in sizes:
        cluster = build_cluster(n, args.seed)
        print(f"\n{n:,} nodes (built by folding events in {cluster.build_s:.2f} s, untimed)")
        print(f"  mixed: {describe(cluster.view, cluster.state)}")
        print(f"  small: {describe(cluster.small)}")
        for case in cases_for(cluster):
            if case.name not in names:
                continue
            gc.collect()
            result = measure(case, n, args)
            results.append(result)
            print(
                f"  {case.name:<16} median {result.median_ms:8.3f} ms  p95 "
                f"{result.p95_ms:8.3f} ms  ({len(result.samples_ns):,} calls)  {result.outcome}"
            )
        if n == sizes[-1]:
            largest = cluster  # for --profile; the smaller clusters are freed

    print()
    print(
        f"Placement time, {TARGET_MS:g} ms target at {TARGET_NODES:,} nodes "
        f"(verdict on p95, place-only cases at {TARGET_NODES:,} nodes):"
    )
    print_table(results)
    print_scaling(results)
    ok = print_verdict(results)
    print("check: every timed result was the intended one (first and last call checked)")

    if args.profile and largest is not None:
        (case,) = [c for c in cases_for(largest) if c.name == args.profile]
        profile(case, args.profile_reps, args.profile_top)
    print(f"\ntotal {time.perf_counter() - started:.1f} s, load average at the end {load()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
