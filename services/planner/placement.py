"""Placement: where an instance's shards run. ``place(cluster, request)`` is a pure function.

Automatic placement, per replica:

1. A model that fits one device (its full need: weights, KV cache for the context, engine
   overhead) goes to one device: a GPU when one fits, else the CPU (RAM) with the most room.
   Replicas prefer nodes no other replica of the instance uses, then devices none uses.
2. A model that fits no single device has its layers split over the fewest nodes that can hold
   it (one device per node, the roomiest first), in proportion to the room each has (largest
   remainder, at least one layer each), as exo does. The roomiest node is the head (rank 0).
3. Nothing fits: a ``Rejection`` that says what was needed and what each device has.

Each replica serves ``slots`` tasks at once, and holds a KV cache of the whole context for each.
A request (or its placement spec) that names the slots gets exactly that many, or a rejection.
Otherwise the devices are chosen as for one slot, and the instance gets as many slots as fit
on them beside the weights, up to ``DEFAULT_MAX_SLOTS`` (one for an embed instance, which
serves one request at a time); an instance placed again keeps at most the slots it has, so
that the runners it keeps need not restart.

Manual placement follows a placement spec (``placement_spec.py``): the listed devices, split
by ``tensor_split`` (or by room when it is absent), checked against the live cluster.

When an instance is placed again, its replicas whose shards are all still on usable devices
are kept as they are (same runners), and only the others are placed anew.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from bus.events import INT32_MAX, ShardAssignment
from projectors.rows import ModelRow
from services.models.cards import Engine
from services.models.footprint import DEFAULT_MAX_SLOTS, MAX_SLOTS, Footprint, context_for
from services.planner.cluster import ClusterView, Device
from services.planner.layers import split_layers
from services.planner.placement_spec import (
    DEFAULT_ROLE,
    MAX_REPLICAS,
    DeviceRef,
    PlacementSpecError,
    parse_placement_spec,
)

MiB = 1024**2


@dataclass(frozen=True)
class ModelInfo:
    """What placement needs to know about the model (from its ``ModelAdded``)."""

    model_id: str
    footprint: Footprint
    context_length: int = 0  # trained context; 0 when unknown
    engine: Engine = "llamacpp"

    @classmethod
    def of(cls, model: ModelRow) -> ModelInfo:
        engine = cast(Engine, (model.engines or ["llamacpp"])[0])
        return cls(model.model_id, Footprint.of(model), model.context_length, engine)


@dataclass(frozen=True)
class PlacementRequest:
    instance_id: str
    model: ModelInfo | None  # None: the model is not known to the cluster
    replicas: int = 1
    context_length: int | None = None
    spec: str | None = None  # a manual placement spec (JSON); None: automatic
    generation: int = 1  # names the new runners, so each placement's are distinct
    avoid: frozenset[str] = frozenset()  # 'node:device's not to use (runners failed there)
    current: tuple[ShardAssignment, ...] = ()  # the shards placed now, when placing again
    role: str = DEFAULT_ROLE
    slots: int | None = None  # tasks each replica serves at once; None: as many as fit
    current_slots: int | None = None  # what the shards placed now serve (None: 1)


@dataclass(frozen=True)
class Placement:
    shards: tuple[ShardAssignment, ...]
    charges: dict[str, int]  # bytes needed per 'node:device'
    shard_bytes: dict[str, int]  # bytes each shard's runner needs, by runner id
    need_bytes: int  # one whole replica
    context_length: int
    kept_replicas: tuple[int, ...] = ()
    slots: int = 1  # tasks each replica serves at once


@dataclass(frozen=True)
class Rejection:
    reason: str
    needed_bytes: int | None = None
    available_bytes: dict[str, int] = field(default_factory=dict)  # usable per 'node:device'


# One replica's stages: (device, layers) in rank order.
Stages = list[tuple[Device, int]]


def max_slots(model: ModelInfo, role: str) -> int:
    """The most slots an instance may ask for: one for an embed instance, whose runners
    serve one request (a batch of inputs) at a time."""
    return 1 if role == "embed" else MAX_SLOTS


def slots_problem(model: ModelInfo, role: str, slots: int) -> str | None:
    """Why an instance of ``model`` cannot have ``slots`` slots, or None."""
    if not 1 <= slots <= MAX_SLOTS:
        return f"slots must be between 1 and {MAX_SLOTS}, not {slots}"
    if slots > max_slots(model, role):
        return f"an embed instance serves one task at a time: slots must be 1, not {slots}"
    return None


def place(cluster: ClusterView, request: PlacementRequest) -> Placement | Rejection:
    model = request.model
    if model is None:
        return Rejection("the model is not known to the cluster: add it with `shoal models add`")
    replicas = request.replicas
    if not 1 <= replicas <= MAX_REPLICAS:
        return Rejection(f"replicas must be between 1 and {MAX_REPLICAS}, not {replicas}")
    ctx = context_for(model.context_length, request.context_length, request.role)
    if ctx > INT32_MAX:
        return Rejection(f"a context of {ctx} tokens is more than any engine takes")
    if model.context_length and ctx > model.context_length:
        return Rejection(
            f"a context of {ctx} tokens is more than {model.model_id} was trained for"
            f" ({model.context_length})"
        )
    manual: list[tuple[tuple[DeviceRef, ...], tuple[float, ...] | None]] | None = None
    asked = request.slots
    if request.spec is not None:
        try:
            role = parse_placement_spec(request.spec).for_role(request.role)
        except PlacementSpecError as exc:
            return Rejection(f"invalid placement: {exc}")
        manual, replicas = role.groups(), role.replicas  # the spec caps its replicas
        asked = role.slots if role.slots is not None else asked
    if asked is not None:
        problem = slots_problem(model, request.role, asked)
        if problem is None and ctx * asked > INT32_MAX:
            problem = f"{asked} slots of {ctx} tokens are more than any engine takes"
        if problem is not None:
            return Rejection(problem)
        placed = _place(cluster, request, model, ctx, asked, replicas, manual)
        if isinstance(placed, Rejection):
            return placed
        return _placement(request, model.footprint, ctx, asked, *placed)
    # The devices as for one slot (a GPU for one slot beats a CPU for eight), then as many
    # slots as fit on them; placed again, no more than the kept runners serve.
    placed = _place(cluster, request, model, ctx, 1, replicas, manual)
    if isinstance(placed, Rejection):
        return placed
    stages, kept = placed
    limit = min(max_slots(model, request.role), DEFAULT_MAX_SLOTS, INT32_MAX // ctx)
    if kept:
        limit = min(limit, request.current_slots or 1)
    fp = model.footprint
    slots = next(
        (n for n in range(limit, 1, -1) if _fits(cluster, _charges(stages.values(), fp, ctx * n))),
        1,
    )
    return _placement(request, fp, ctx, slots, stages, kept)


def _fits(cluster: ClusterView, charges: dict[str, int]) -> bool:
    return all(need <= cluster.devices[ref].usable for ref, need in charges.items())


def _place(
    cluster: ClusterView,
    request: PlacementRequest,
    model: ModelInfo,
    ctx: int,
    slots: int,
    replicas: int,
    manual: list[tuple[tuple[DeviceRef, ...], tuple[float, ...] | None]] | None,
) -> tuple[dict[int, Stages], tuple[int, ...]] | Rejection:
    """Each replica's stages for ``slots`` slots of ``ctx`` tokens, and the replicas kept."""
    fp = model.footprint
    tokens = ctx * slots  # the KV cache a whole replica holds
    spec_refs = None if manual is None else [[str(r) for r in devices] for devices, _ in manual]
    kept = _kept_replicas(cluster, request, replicas, spec_refs)
    view = cluster.reserve(_charges(kept.values(), fp, tokens))
    placed: dict[int, Stages] = dict(kept)
    for replica in range(replicas):
        if replica in placed:
            continue
        if manual is not None:
            devices, weights = manual[replica]
            result = _manual(view, fp, tokens, devices, weights, request.avoid)
        else:
            result = _auto(view, fp, tokens, request.avoid, _used(placed.values()))
        if isinstance(result, Rejection):
            return _for_replica(result, replica, replicas, model, ctx, slots, view, request.avoid)
        placed[replica] = result
        view = view.reserve(_charges([result], fp, tokens))
    return placed, tuple(sorted(kept))


def _placement(
    request: PlacementRequest,
    fp: Footprint,
    ctx: int,
    slots: int,
    placed: dict[int, Stages],
    kept: tuple[int, ...],
) -> Placement:
    tokens = ctx * slots
    shards = tuple(
        shard
        for replica in sorted(placed)
        for shard in _shards(request, replica, placed[replica], fp.n_layers)
    )
    charges = _charges(placed.values(), fp, tokens)
    shard_bytes = {s.runner_id: fp.need_bytes(tokens, s.end_layer - s.start_layer)
                   for s in shards}  # fmt: skip
    return Placement(shards, charges, shard_bytes, fp.need_bytes(tokens), ctx, kept, slots)


def _auto(
    view: ClusterView, fp: Footprint, tokens: int, avoid: frozenset[str], used: set[str]
) -> Stages | Rejection:
    candidates = [d for d in view.devices.values() if d.ref not in avoid]
    need = fp.need_bytes(tokens)
    used_nodes = {ref.rpartition(":")[0] for ref in used}
    fitting = [d for d in candidates if d.usable >= need]
    tiers = (
        [d for d in fitting if d.node_id not in used_nodes],  # a node no replica uses
        [d for d in fitting if d.ref not in used],  # a device none uses
        fitting,
    )
    for tier in tiers:
        if tier:
            best = min(tier, key=lambda d: (d.kind != "gpu", -d.usable, d.ref))
            return [(best, fp.n_layers)]
    fresh = [d for d in candidates if d.node_id not in used_nodes]
    for pool in (fresh, candidates) if used_nodes else (candidates,):
        stages = _split(pool, fp, tokens)
        if stages is not None:
            return stages
    return Rejection("does not fit")  # _for_replica words it


def _split(pool: Iterable[Device], fp: Footprint, tokens: int) -> Stages | None:
    """The fewest nodes (one device each, the roomiest first) that hold the model between
    them, layers in proportion to each one's room for layers; None when no number does.
    (``tokens``, here and below: the KV cache a replica holds, its context times its slots.)"""
    best: dict[str, Device] = {}
    for d in pool:
        other = best.get(d.node_id)
        if other is None or (d.usable, d.kind == "gpu") > (other.usable, other.kind == "gpu"):
            best[d.node_id] = d
    nodes = sorted(best.values(), key=lambda d: (-d.usable, d.ref))
    body = fp.need_bytes(tokens) - fp.overhead_bytes  # weights and KV cache, to be divided
    smallest_share = fp.need_bytes(tokens, 1)
    room = 0
    for k in range(1, min(len(nodes), fp.n_layers) + 1):
        if nodes[k - 1].usable < smallest_share:
            break  # this node cannot take even one layer, nor can any smaller one
        room += nodes[k - 1].usable - fp.overhead_bytes
        if k < 2 or room < body:
            continue
        chosen = nodes[:k]
        layers = split_layers(fp.n_layers, [d.usable - fp.overhead_bytes for d in chosen])
        if all(fp.need_bytes(tokens, n) <= d.usable for d, n in zip(chosen, layers, strict=True)):
            return list(zip(chosen, layers, strict=True))
    return None


def _manual(
    view: ClusterView,
    fp: Footprint,
    tokens: int,
    refs: Sequence[DeviceRef],
    weights: Sequence[float] | None,
    avoid: frozenset[str],
) -> Stages | Rejection:
    devices: list[Device] = []
    for ref in refs:
        device = _live_device(view, ref)
        if isinstance(device, Rejection):
            return device
        if device.ref in avoid:
            return Rejection(f"runners of this instance kept failing on {device.ref}")
        devices.append(device)
    if len(devices) > fp.n_layers:
        return Rejection(f"{len(devices)} devices for a model of {fp.n_layers} layers")
    if weights is None:
        # Without tensor_split, by the room each device has for layers (as automatic does).
        weights = [max(d.usable - fp.overhead_bytes, 1) for d in devices]
    layers = split_layers(fp.n_layers, weights)
    for device, n in zip(devices, layers, strict=True):
        need = fp.need_bytes(tokens, n)
        if need > device.usable:
            share = "the whole model" if n == fp.n_layers else f"{n} of {fp.n_layers} layers"
            return Rejection(
                f"{device.ref}: its share ({share}) needs {gib(need)} but"
                f" {gib(max(device.usable, 0))} is usable there",
                needed_bytes=need,
                available_bytes={device.ref: max(device.usable, 0)},
            )
    return list(zip(devices, layers, strict=True))


def _live_device(view: ClusterView, ref: DeviceRef) -> Device | Rejection:
    status = view.node_status.get(ref.node_id)
    if status is None:
        known = ", ".join(sorted(view.node_status)) or "none"
        return Rejection(f"unknown node {ref.node_id!r} (nodes: {known})")
    if status != "online":
        return Rejection(f"node {ref.node_id!r} is {status.replace('_', ' ')}")
    device = view.devices.get(str(ref))
    if device is None:
        has = ", ".join(sorted(d.device for d in view.devices_of(ref.node_id))) or "none"
        return Rejection(f"node {ref.node_id!r} has no device {ref.device} (it has: {has})")
    return device


def _kept_replicas(
    cluster: ClusterView,
    request: PlacementRequest,
    replicas: int,
    groups: list[list[str]] | None,
) -> dict[int, Stages]:
    """Replicas of the current placement that can stay: every shard on a live, not avoided
    device, and (under a spec, whose replicas' devices are ``groups``) exactly where the spec
    puts that replica."""
    by_replica: dict[int, list[ShardAssignment]] = defaultdict(list)
    for shard in request.current:
        by_replica[shard.replica].append(shard)
    kept: dict[int, Stages] = {}
    for replica, shards in by_replica.items():
        shards.sort(key=lambda s: s.rank)
        refs = [f"{s.node_id}:{s.device}" for s in shards]
        if replica >= replicas or any(r not in cluster.devices or r in request.avoid for r in refs):
            continue
        if groups is not None and refs != groups[replica]:
            continue
        kept[replica] = [
            (cluster.devices[r], s.end_layer - s.start_layer)
            for r, s in zip(refs, shards, strict=True)
        ]
    return kept


def _used(placed: Iterable[Stages]) -> set[str]:
    return {device.ref for stages in placed for device, _ in stages}


def _charges(placed: Iterable[Stages], fp: Footprint, tokens: int) -> dict[str, int]:
    charges: dict[str, int] = defaultdict(int)
    for stages in placed:
        for device, n in stages:
            charges[device.ref] += fp.need_bytes(tokens, n)
    return dict(charges)


def _shards(
    request: PlacementRequest, replica: int, stages: Stages, n_layers: int
) -> list[ShardAssignment]:
    current = {(s.replica, s.rank): s for s in request.current if s.replica == replica}
    split = [float(n) for _, n in stages] if len(stages) > 1 else None
    shards: list[ShardAssignment] = []
    start = 0
    for rank, (device, n) in enumerate(stages):
        shard = ShardAssignment(
            runner_id=f"{request.instance_id}-g{request.generation}-r{replica}-s{rank}",
            node_id=device.node_id,
            device=device.device,
            replica=replica,
            rank=rank,
            world_size=len(stages),
            start_layer=start,
            end_layer=start + n,
            n_layers=n_layers,
            tensor_split=split,
        )
        old = current.get((replica, rank))
        if old is not None and old.model_copy(update={"runner_id": shard.runner_id}) == shard:
            shard = old  # a kept shard keeps its runner
        shards.append(shard)
        start += n
    return shards


def _for_replica(
    rejection: Rejection,
    replica: int,
    replicas: int,
    model: ModelInfo,
    ctx: int,
    slots: int,
    view: ClusterView,
    avoid: frozenset[str],
) -> Rejection:
    """Words a rejection for the user: which replica, what was needed, what each device has."""
    prefix = f"replica {replica + 1} of {replicas}: " if replicas > 1 else ""
    if rejection.reason != "does not fit":
        return Rejection(
            prefix + rejection.reason, rejection.needed_bytes, rejection.available_bytes
        )
    fp = model.footprint
    need = fp.need_bytes(ctx, slots=slots)
    usable = {ref: max(d.usable, 0) for ref, d in view.devices.items() if ref not in avoid}
    avoided = sorted(avoid & set(view.devices))
    failing = ", where its runners kept failing"
    not_used = f"; not used: {', '.join(avoided)}{failing}" if avoided else ""
    if not usable:
        where = "no node is online to place it on"
        if avoided:
            where = f"the only devices online are {', '.join(avoided)}{failing}"
        return Rejection(prefix + f"{model.model_id} needs {gib(need)} and {where}", need, {})
    largest = sorted(usable.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{ref} {gib(b)}" for ref, b in largest[:8])
    more = f" and {len(largest) - 8} more" if len(largest) > 8 else ""
    each = f" for each of {slots} slots" if slots > 1 else ""
    reason = (
        f"{model.model_id} needs {gib(need)} for a context of {ctx} tokens{each} (weights"
        f" {gib(fp.weights_bytes)}, KV cache {gib(fp.kv_bytes_per_token * ctx * slots)}, engine"
        f" {gib(fp.overhead_bytes)} per runner), more than any device or set of nodes can"
        f" hold. Usable now (90% of what is offered, less what is placed): {shown}{more}"
        f"{not_used}"
    )
    return Rejection(prefix + reason, need, dict(largest[:100]))


def gib(n: int) -> str:
    """Bytes for people: GiB with two decimals, MiB below one GiB."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / MiB:.0f} MiB"
