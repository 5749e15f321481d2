"""Placement: where an instance's shards run. ``place(cluster, request)`` is a pure function.

Automatic placement, per replica (only devices that run the model's engine count):

1. A model that one node holds (its full need: weights, KV cache for the context and slots,
   engine overhead) goes to one node, in the best way that node's devices allow
   (``node_plan``): one GPU; else several GPUs of the node, layers in proportion to their
   room; else as many layers as its GPUs hold and the rest in RAM; else all in RAM. Replicas
   prefer nodes no other replica of the instance uses, then devices none uses; then the best
   way, the roomiest device.
2. A model that no node holds has its layers split over the fewest nodes that can hold it
   (one device per node, the roomiest first), in proportion to the room each has (largest
   remainder, at least one layer each), as exo does. The roomiest node is the head (rank 0);
   a llama.cpp head keeps its layers in RAM (``engine_devices``).
3. Nothing fits: a ``Rejection`` that says what was needed and what each device has.

Each replica's placement says why it went where it did (``Placement.why``, worded in
``placement_why.py``), for the preview.

Each replica serves ``slots`` tasks at once, and holds a KV cache of the whole context for each.
A request (or its placement spec) that names the slots gets exactly that many, or a rejection.
Otherwise the devices are chosen as for one slot, and the instance gets as many slots as fit
on them beside the weights, up to ``DEFAULT_MAX_SLOTS`` (one for an embed instance, which
serves one request at a time); an instance placed again keeps at most the slots it has, so
that the runners it keeps need not restart.

Each replica's KV cache is of the type the request names (``kv_cache``: f16, q8_0, q4_0), its
memory scaled by the type (``Footprint.with_kv_cache``). ``auto`` tries f16, then q8_0, then
q4_0, and takes the first that places (an instance placed again tries the type its runners
use first, so that the kept ones need not restart); when none does, the rejection says what
was tried. The MLX engine keeps an f16 cache: a quantized type for it is refused.

Manual placement (``manual.py``) follows a placement spec (``placement_spec.py``): the listed
devices, split by ``tensor_split`` (or by room when it is absent), checked against the live
cluster.

When an instance is placed again, its replicas whose shards are all still on usable devices
are kept as they are (same runners), and only the others are placed anew.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from events.kinds import (
    DEFAULT_KV_CACHE,
    DEFAULT_ROLE,
    Engine,
    InstanceRole,
    KvCacheRequest,
    KvCacheType,
    main_engine,
)
from events.records import INT32_MAX, DeviceLayers, ShardAssignment
from projectors.rows import ModelRow
from services.models.footprint import DEFAULT_MAX_SLOTS, MAX_SLOTS, Footprint, context_for
from services.planner.cluster import ClusterView, Device, device_layers
from services.planner.engine_devices import ENGINE_DEVICES
from services.planner.kv_cache import kv_cache_candidates, kv_cache_problem
from services.planner.layers import split_layers
from services.planner.manual import place_by_spec
from services.planner.node_plan import (
    CPU,
    ONE_GPU,
    Option,
    Stage,
    Stages,
    one_device,
    shared_options,
)
from services.planner.placed import Placed as Placed
from services.planner.placed import Rejection as Rejection
from services.planner.placed import charges_of
from services.planner.placement_spec import (
    MAX_REPLICAS,
    DeviceRef,
    PlacementSpecError,
    parse_placement_spec,
)
from services.planner.placement_why import gib, why_node, why_split


@dataclass(frozen=True)
class ModelInfo:
    """What placement needs to know about the model (from its ``ModelAdded``)."""

    model_id: str
    footprint: Footprint
    context_length: int = 0  # trained context; 0 when unknown
    engine: Engine = "llamacpp"
    node_id: str | None = None  # the only node with the weights (added --local); None: any

    @classmethod
    def of(cls, model: ModelRow) -> ModelInfo:
        engine = main_engine(model.engines)
        return cls(model.model_id, Footprint.of(model), model.context_length, engine, model.node_id)


@dataclass(frozen=True)
class PlacementRequest:
    instance_id: str
    model: ModelInfo | None  # None: the model is not known to the cluster
    replicas: int = 1
    context_length: int | None = None
    spec: str | None = None  # a manual placement spec (JSON); None: automatic
    generation: int = 1  # names the new runners, so each placement's are distinct
    avoid: frozenset[str] = frozenset()  # 'node:device's not to use (runners failed there)
    # The latest error of the runners that failed there, by 'node:device', to say why.
    failures: tuple[tuple[str, str], ...] = ()
    current: tuple[ShardAssignment, ...] = ()  # the shards placed now, when placing again
    role: InstanceRole = DEFAULT_ROLE
    slots: int | None = None  # tasks each replica serves at once; None: as many as fit
    current_slots: int | None = None  # what the shards placed now serve (None: 1)
    kv_cache: KvCacheRequest = DEFAULT_KV_CACHE  # the KV cache's type, or auto
    current_kv_cache: KvCacheType | None = None  # what the shards placed now use


@dataclass(frozen=True)
class Placement:
    shards: tuple[ShardAssignment, ...]
    charges: dict[str, int]  # bytes needed per 'node:device'
    shard_bytes: dict[str, int]  # bytes each shard's runner needs, by runner id
    need_bytes: int  # one whole replica
    context_length: int
    kept_replicas: tuple[int, ...] = ()
    slots: int = 1  # tasks each replica serves at once
    why: tuple[str, ...] = ()  # why each replica went where it did, by replica
    kv_cache: KvCacheType = DEFAULT_KV_CACHE  # the KV cache's type


def max_slots(model: ModelInfo, role: InstanceRole) -> int:
    """The most slots an instance may ask for: one for an embed or rerank instance, whose
    runners serve one request (a batch of inputs) at a time."""
    return MAX_SLOTS if role == "chat" else 1


def slots_problem(model: ModelInfo, role: InstanceRole, slots: int) -> str | None:
    """Why an instance of ``model`` cannot have ``slots`` slots, or None."""
    if not 1 <= slots <= MAX_SLOTS:
        return f"slots must be between 1 and {MAX_SLOTS}, not {slots}"
    if slots > max_slots(model, role):
        article = "an" if role[0] in "aeiou" else "a"
        return f"{article} {role} instance serves one task at a time: slots must be 1, not {slots}"
    return None


def place(cluster: ClusterView, request: PlacementRequest) -> Placement | Rejection:
    model = request.model
    if model is None:
        return Rejection("the model is not known to the cluster: add it with `shoal models add`")
    if (problem := kv_cache_problem(model.engine, request.role, request.kv_cache)) is not None:
        return Rejection(problem)
    candidates = kv_cache_candidates(
        model.engine, request.role, request.kv_cache, request.current_kv_cache
    )
    result: Placement | Rejection = Rejection("no KV-cache type to try")
    for kv in candidates:
        with_kv = replace(model, footprint=model.footprint.with_kv_cache(kv))
        # Runners keep the type they were started with: one of another type keeps none.
        same = request.current_kv_cache in (None, kv)
        result = _place_with_kv(cluster, request if same else replace(request, current=()), with_kv)
        if isinstance(result, Placement) and kv != DEFAULT_KV_CACHE and _pipelined(result):
            result = Rejection(
                f"kv_cache {kv}: {model.model_id} would be split over several nodes, whose"
                " pipeline keeps an f16 KV cache (flash attention, which a quantized cache needs,"
                " stays off across stages)",
                result.need_bytes,
            )
        if isinstance(result, Placement):
            return replace(result, kv_cache=kv)
        if result.needed_bytes is None:
            return result  # not a want of memory: another type would not help
    if len(candidates) > 1 and isinstance(result, Rejection):
        tried = ", ".join(candidates)
        return Rejection(
            f"kv_cache auto tried {tried}; with the smallest, {candidates[-1]}: {result.reason}",
            result.needed_bytes,
            result.available_bytes,
        )
    return result


def _pipelined(placement: Placement) -> bool:
    """Whether a replica is a pipeline of several runners (over several nodes)."""
    return any(shard.world_size > 1 for shard in placement.shards)


def _place_with_kv(
    cluster: ClusterView, request: PlacementRequest, model: ModelInfo
) -> Placement | Rejection:
    """``place`` for a model whose footprint counts the KV cache of one type."""
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
    if model.node_id is not None:
        # A model kept at a path on one node (added --local) runs there or nowhere.
        elsewhere = sorted({d.node_id for g, _ in manual or [] for d in g} - {model.node_id})
        if elsewhere:
            return Rejection(
                f"{model.model_id} is kept on node {model.node_id} only (added with"
                f" --local), not on {', '.join(elsewhere)}"
            )
        if cluster.node_status.get(model.node_id) != "online":
            return Rejection(
                f"{model.model_id} is kept on node {model.node_id} only (added with"
                " --local), which is not online"
            )
        cluster = cluster.on_node(model.node_id)
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
    chosen, kept = placed
    limit = min(max_slots(model, request.role), DEFAULT_MAX_SLOTS, INT32_MAX // ctx)
    if kept:
        limit = min(limit, request.current_slots or 1)
    fp = model.footprint
    stages = [p.stages for p in chosen.values()]
    slots = next(
        (n for n in range(limit, 1, -1) if cluster.fits(charges_of(stages, fp, ctx * n))), 1
    )
    return _placement(request, fp, ctx, slots, chosen, kept)


def _place(
    cluster: ClusterView,
    request: PlacementRequest,
    model: ModelInfo,
    ctx: int,
    slots: int,
    replicas: int,
    manual: list[tuple[tuple[DeviceRef, ...], tuple[float, ...] | None]] | None,
) -> tuple[dict[int, Placed], tuple[int, ...]] | Rejection:
    """Each replica's stages for ``slots`` slots of ``ctx`` tokens, and the replicas kept."""
    fp = model.footprint
    tokens = ctx * slots  # the KV cache a whole replica holds
    spec_refs = None if manual is None else [sorted(map(str, devices)) for devices, _ in manual]
    kept = _kept_replicas(cluster, request, replicas, spec_refs)
    view = cluster.reserve(charges_of([p.stages for p in kept.values()], fp, tokens))
    placed: dict[int, Placed] = dict(kept)
    for replica in range(replicas):
        if replica in placed:
            continue
        if manual is not None:
            devices, weights = manual[replica]
            result = place_by_spec(view, fp, tokens, devices, weights, request.avoid, model.engine)
        else:
            used = _used(placed.values())
            result = _auto(view, fp, tokens, request.avoid, used, model.engine)
        if isinstance(result, Rejection):
            return _for_replica(result, replica, replicas, model, ctx, slots, view, request)
        placed[replica] = result
        view = view.reserve(charges_of([result.stages], fp, tokens))
    return placed, tuple(sorted(kept))


def _placement(
    request: PlacementRequest,
    fp: Footprint,
    ctx: int,
    slots: int,
    placed: dict[int, Placed],
    kept: tuple[int, ...],
) -> Placement:
    tokens = ctx * slots
    shards: list[ShardAssignment] = []
    shard_bytes: dict[str, int] = {}
    for replica in sorted(placed):
        stages = placed[replica].stages
        for shard, stage in zip(
            _shards(request, replica, stages, fp.n_layers), stages, strict=True
        ):
            shards.append(shard)
            shard_bytes[shard.runner_id] = sum(stage.charges(fp, tokens).values())
    charges = charges_of([p.stages for p in placed.values()], fp, tokens)
    why = tuple(placed[r].why for r in sorted(placed))
    return Placement(
        tuple(shards), charges, shard_bytes, fp.need_bytes(tokens), ctx, kept, slots, why
    )


def _auto(
    view: ClusterView,
    fp: Footprint,
    tokens: int,
    avoid: frozenset[str],
    used: set[str],
    engine: Engine,
) -> Placed | Rejection:
    need = fp.need_bytes(tokens)
    candidates = [d for d in view.devices.values() if d.ref not in avoid and d.runs(engine)]
    used_nodes = {ref.rpartition(":")[0] for ref in used}
    gpus = [d for d in candidates if d.is_accelerator and d.usable >= need]
    cpus = [d for d in candidates if not d.is_accelerator and d.usable >= need]
    shared: list[Option] | None = None  # made only when no single GPU holds it
    # A node no replica uses, then devices none uses, then any; in each, the best shape
    # (node_plan), then the most room. One GPU or the CPU alone is compared over the whole
    # cluster directly: building every node's ways for each replica made a round slow.
    tiers: list[Callable[[Iterable[str]], bool]] = [lambda refs: True]
    if used:
        tiers[:0] = [
            lambda refs: not used_nodes.intersection(_node(r) for r in refs),
            used.isdisjoint,
        ]
    for fresh in tiers:
        best: Option | None = None
        on_gpu = [d for d in gpus if fresh([d.ref])]
        if on_gpu:
            best = Option(one_device(min(on_gpu, key=_roomiest), fp.n_layers), ONE_GPU)
        else:
            if shared is None:
                shared = _shared(candidates, fp, tokens, engine)
            spread = [o for o in shared if fresh(o.stage.refs)]
            in_ram = [d for d in cpus if fresh([d.ref])]
            if spread:
                best = min(spread, key=Option.key)
            elif in_ram:
                best = Option(one_device(min(in_ram, key=_roomiest), fp.n_layers), CPU)
        if best is not None:
            return Placed([best.stage], why_node(best, bool(gpus), view, fp, tokens, engine, avoid))
    fresh_pool = [d for d in candidates if d.node_id not in used_nodes]
    for pool in (fresh_pool, candidates) if used_nodes else (candidates,):
        stages = _split(pool, fp, tokens, engine)
        if stages is not None:
            return Placed(stages, why_split(stages, fp, tokens, engine, candidates))
    return Rejection("does not fit")  # _for_replica words it


def _node(ref: str) -> str:
    return ref.rpartition(":")[0]


def _roomiest(d: Device) -> tuple[int, str]:
    return (-d.usable, d.ref)


def _shared(
    candidates: Sequence[Device], fp: Footprint, tokens: int, engine: Engine
) -> list[Option]:
    """Every node's ways of holding the model on several of its devices (node_plan), for the
    nodes whose devices have the room between them."""
    need = fp.need_bytes(tokens)
    accelerators: dict[str, list[Device]] = defaultdict(list)
    cpus: dict[str, Device] = {}
    for d in candidates:
        if d.is_accelerator:
            accelerators[d.node_id].append(d)
        else:
            cpus[d.node_id] = d
    options: list[Option] = []
    for node_id, devices in accelerators.items():
        cpu = cpus.get(node_id)
        room = sum(max(d.usable, 0) for d in devices) + (max(cpu.usable, 0) if cpu else 0)
        if room >= need:  # every way needs at least the whole model's need between them
            options += shared_options(devices, cpu, fp, tokens, engine)
    return options


def _split(pool: Iterable[Device], fp: Footprint, tokens: int, engine: Engine) -> Stages | None:
    """The fewest nodes (one device each, the roomiest first) that hold the model between
    them, layers in proportion to each one's room for layers; None when no number does.
    (``tokens``, here and below: the KV cache a replica holds, its context times its slots.)
    An engine whose pipeline head keeps its layers in RAM has the CPU of the chosen node with
    the most room in RAM as its head."""
    best: dict[str, Device] = {}
    cpus: dict[str, Device] = {}
    for d in pool:
        if not d.is_accelerator:
            cpus[d.node_id] = d
        other = best.get(d.node_id)
        key = (d.usable, d.is_accelerator)
        if other is None or key > (other.usable, other.is_accelerator):
            best[d.node_id] = d
    nodes = sorted(best.values(), key=lambda d: (-d.usable, d.ref))
    body = fp.need_bytes(tokens) - fp.overhead_bytes  # weights and KV cache, to be divided
    smallest_share = fp.need_bytes(tokens, 1)
    head_in_ram = not ENGINE_DEVICES[engine].accelerated_head
    room = 0
    for k in range(1, min(len(nodes), fp.n_layers) + 1):
        if nodes[k - 1].usable < smallest_share:
            break  # this node cannot take even one layer, nor can any smaller one
        room += nodes[k - 1].usable - fp.overhead_bytes
        if k < 2 or room < body:
            continue
        chosen = nodes[:k]
        if head_in_ram:
            in_ram = [cpus[d.node_id] for d in chosen if d.node_id in cpus]
            if not in_ram:
                continue
            head = min(in_ram, key=lambda d: (-d.usable, d.ref))
            chosen = [head, *(d for d in chosen if d.node_id != head.node_id)]
        rooms = [d.usable - fp.overhead_bytes for d in chosen]
        if min(rooms) <= 0:
            continue
        layers = split_layers(fp.n_layers, rooms)
        if all(fp.need_bytes(tokens, n) <= d.usable for d, n in zip(chosen, layers, strict=True)):
            return [one_device(d, n) for d, n in zip(chosen, layers, strict=True)]
    return None


def _kept_replicas(
    cluster: ClusterView,
    request: PlacementRequest,
    replicas: int,
    groups: list[list[str]] | None,
) -> dict[int, Placed]:
    """Replicas of the current placement that can stay: every shard on live, not avoided
    devices, and (under a spec, whose replicas' devices are ``groups``, sorted) exactly where
    the spec puts that replica."""
    by_replica: dict[int, list[ShardAssignment]] = defaultdict(list)
    for shard in request.current:
        by_replica[shard.replica].append(shard)
    kept: dict[int, Placed] = {}
    for replica, shards in by_replica.items():
        shards.sort(key=lambda s: s.rank)
        parts = [[(f"{s.node_id}:{d}", n) for d, n in device_layers(s)] for s in shards]
        refs = [ref for stage in parts for ref, _ in stage]
        if replica >= replicas or any(r not in cluster.devices or r in request.avoid for r in refs):
            continue
        if groups is not None and sorted(refs) != groups[replica]:
            continue
        stages = [Stage(tuple((cluster.devices[r], n) for r, n in stage)) for stage in parts]
        kept[replica] = Placed(stages, "kept where its runners run")
    return kept


def _used(placed: Iterable[Placed]) -> set[str]:
    return {ref for p in placed for stage in p.stages for ref in stage.refs}


def _shards(
    request: PlacementRequest, replica: int, stages: Stages, n_layers: int
) -> list[ShardAssignment]:
    current = {(s.replica, s.rank): s for s in request.current if s.replica == replica}
    split = [float(stage.layers) for stage in stages] if len(stages) > 1 else None
    shards: list[ShardAssignment] = []
    start = 0
    for rank, stage in enumerate(stages):
        parts = [DeviceLayers(device=d.device, layers=n) for d, n in stage.parts]
        shard = ShardAssignment(
            runner_id=f"{request.instance_id}-g{request.generation}-r{replica}-s{rank}",
            node_id=stage.node_id,
            device=stage.main.device,
            devices=parts if len(parts) > 1 else [],
            replica=replica,
            rank=rank,
            world_size=len(stages),
            start_layer=start,
            end_layer=start + stage.layers,
            n_layers=n_layers,
            tensor_split=split,
        )
        old = current.get((replica, rank))
        if old is not None and old.model_copy(update={"runner_id": shard.runner_id}) == shard:
            shard = old  # a kept shard keeps its runner
        shards.append(shard)
        start += stage.layers
    return shards


# --- why ------------------------------------------------------------------------------------


def _for_replica(
    rejection: Rejection,
    replica: int,
    replicas: int,
    model: ModelInfo,
    ctx: int,
    slots: int,
    view: ClusterView,
    request: PlacementRequest,
) -> Rejection:
    """Words a rejection for the user: which replica, what was needed, what each device has."""
    avoid = request.avoid
    prefix = f"replica {replica + 1} of {replicas}: " if replicas > 1 else ""
    if rejection.reason != "does not fit":
        return Rejection(
            prefix + rejection.reason, rejection.needed_bytes, rejection.available_bytes
        )
    fp = model.footprint
    need = fp.need_bytes(ctx, slots=slots)
    usable = {ref: max(d.usable, 0) for ref, d in view.devices.items() if ref not in avoid}
    avoided = sorted(avoid & set(view.devices))
    errors = dict(request.failures)
    failing = ", where its runners kept failing" + "".join(
        f" ({ref}: {errors[ref]})" for ref in avoided if errors.get(ref)
    )
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
    kv = f" {fp.kv_cache}" if fp.kv_cache != DEFAULT_KV_CACHE else ""
    reason = (
        f"{model.model_id} needs {gib(need)} for a context of {ctx} tokens{each} (weights"
        f" {gib(fp.weights_bytes)}, KV cache {gib(fp.kv_bytes_per_token * ctx * slots)}{kv},"
        f" engine {gib(fp.overhead_bytes)} per runner), more than any device or set of nodes can"
        f" hold. Usable now (90% of what is offered, less what is placed): {shown}{more}"
        f"{not_used}"
    )
    return Rejection(prefix + reason, need, dict(largest[:100]))
