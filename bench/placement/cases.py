"""What ``bench.placement`` times, on a cluster of ``clusters``: each case's call, and
the check that its result is the one the case is meant to time (the intended path, computed
here independently).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from bench.placement.clusters import (
    LLAMA_8B,
    LLAMA_70B,
    LLAMA_405B,
    PENDING,
    T0,
    TOO_BIG,
    Cluster,
    info,
    need_of,
)
from events.catalogue import InstancePlaced, ModelAdded
from events.records import ShardAssignment
from services.planner.cluster import ClusterView, Device, cluster_view
from services.planner.decisions import Decision, PlannerPolicy, decide
from services.planner.placement import Placement, PlacementRequest, Rejection, place

NOW = T0 + timedelta(seconds=10)  # one heartbeat interval after the profiles: no time-outs
POLICY = PlannerPolicy()


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


def node_holds(view: ClusterView, added: ModelAdded) -> list[str]:
    """The nodes whose GPUs (as many layers as fit on each) and RAM (the rest) hold the model:
    llama.cpp's way of spreading one runner over a node's devices."""
    n = added.n_layers
    by_node: dict[str, list[Device]] = {}
    for d in view.devices.values():
        by_node.setdefault(d.node_id, []).append(d)

    def layers_on(d: Device) -> int:
        return max((k for k in range(1, n + 1) if need_of(added, k) <= d.usable), default=0)

    return [
        node_id
        for node_id, devices in by_node.items()
        if any(d.kind == "gpu" for d in devices) and sum(map(layers_on, devices)) >= n
    ]


def split_check(view: ClusterView, added: ModelAdded) -> Check:
    require(
        not any(d.usable >= need_of(added) for d in view.devices.values()),
        f"{added.model_id} fits one device: the case would not time a split",
    )
    nodes = node_holds(view, added)
    if nodes:
        return spread_check(view, added, nodes)
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


def spread_check(view: ClusterView, added: ModelAdded, nodes: list[str]) -> Check:
    """One node holds the model across its devices: one runner, layers on its GPUs and RAM."""

    def check(result: object) -> str:
        p = a_placement(result)
        require(len(p.shards) == 1, f"expected one runner, got {len(p.shards)}")
        (s,) = p.shards
        require(s.node_id in nodes, f"on {s.node_id}, which cannot hold it")
        require(len(s.devices) > 1, "one runner on one device: no split between devices")
        require(sum(d.layers for d in s.devices) == added.n_layers, "layers missing")
        for part in s.devices:
            share = need_of(added, part.layers)
            dev = view.devices[f"{s.node_id}:{part.device}"]
            require(share <= dev.usable, f"{dev.ref} cannot hold its share")
        check_layers(p, added.n_layers)
        return f"one node, {len(s.devices)} devices"

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
            split = any(s.world_size > 1 or s.devices for s in e.shards)
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


def roomiest(view: ClusterView, count: int, *, cpu: bool = False) -> list[Device]:
    """The roomiest devices (CPUs only, with ``cpu``), one per node."""
    chosen: list[Device] = []
    for d in sorted(view.devices.values(), key=lambda d: (-d.usable, d.ref)):
        if (not cpu or d.kind == "cpu") and all(c.node_id != d.node_id for c in chosen):
            chosen.append(d)
    return chosen[:count]


def heads_and_tails(view: ClusterView, count: int) -> tuple[list[Device], list[Device]]:
    """``count`` roomiest CPUs (a llama.cpp pipeline's head keeps its layers in RAM), and the
    roomiest device on ``count`` other nodes."""
    heads = roomiest(view, count, cpu=True)
    taken = {d.node_id for d in heads}
    others = [d for d in roomiest(view, len(view.devices)) if d.node_id not in taken]
    return heads, others[:count]


def ask(
    added: ModelAdded, instance_id: str = "new", replicas: int = 1, spec: str | None = None
) -> PlacementRequest:
    return PlacementRequest(instance_id, info(added), replicas=replicas, spec=spec)


def cases_for(c: Cluster) -> list[Case]:
    v, small = c.view, c.small
    n70 = LLAMA_70B.n_layers
    big, second = (n70 * 3 // 4, n70 - n70 * 3 // 4)  # tensor_split [3, 1]

    (head,), (tail,) = heads_and_tails(v, 1)
    d = [head, tail]
    two = json.dumps({"chat": {"devices": [x.ref for x in d], "tensor_split": [3, 1]}})
    two_expected = [(0, d[0].ref, big), (0, d[1].ref, second)]

    heads, tails = heads_and_tails(v, 2)
    four = [heads[0], tails[1], heads[1], tails[0]]  # the heads take the larger shares
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
