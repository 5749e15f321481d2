"""The cluster as placement sees it: the devices of online nodes and the memory left on each.

A pure function of the projection. A device's usable memory is what its node offers (RAM for
``cpu``, the card's memory for an accelerator) less a 10% headroom, less what the shards
already placed there need. Offered memory excludes nothing Shoal itself uses (the worker adds
its own runners back), so a placed shard is counted once, here.

An accelerator whose memory is its node's RAM (Apple silicon's GPU, an integrated GPU) offers
its own limit (the GPU's working set) but never more than the node's RAM has left: what is
placed on it or on the node's CPU counts on both, they draw on one memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from events.records import ShardAssignment
from projectors.rows import RunnerRow
from projectors.state import ClusterState
from services.models.footprint import Footprint, context_for

HEADROOM = 0.10
# Instances whose runners hold memory: placed ones, and ones being deleted until they are.
HOLDING = frozenset({"placed", "deleting"})


@dataclass(frozen=True, slots=True)
class Device:
    node_id: str
    device: str  # 'cpu', an accelerator ('cuda0', 'metal0'), or 'gpuN' (older workers)
    kind: str  # 'cpu' or 'gpu'
    capacity: int  # bytes the node offers on this device
    reserved: int = 0  # bytes that shards placed here need
    backend: str | None = None  # an accelerator's; None for the CPU and a gpuN
    shares_ram: bool = False  # an accelerator whose memory is the node's RAM
    engines: frozenset[str] | None = None  # the engines that run on it; None: any
    ram: int | None = None  # a unified accelerator's: the RAM its node offers
    shared: int = 0  # bytes placed on the devices whose memory is this one's

    @property
    def ref(self) -> str:
        return f"{self.node_id}:{self.device}"

    @property
    def usable(self) -> int:
        own = int(self.capacity * (1 - HEADROOM)) - self.reserved
        if self.ram is None and not self.shared:
            return own
        memory = self.capacity if self.ram is None else self.ram
        return min(own, int(memory * (1 - HEADROOM)) - self.reserved - self.shared)

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    def runs(self, engine: str) -> bool:
        return self.engines is None or engine in self.engines


@dataclass(frozen=True)
class ClusterView:
    devices: Mapping[str, Device]  # by ref ('node:device'), online nodes only
    node_status: Mapping[str, str]  # every known node: online | left | timed_out
    # The devices whose memory is one (a unified GPU and its node's CPU), by each one's ref;
    # only nodes with such a GPU are here. Made from ``devices`` when not given.
    shared: Mapping[str, tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        if self.shared is None:
            object.__setattr__(self, "shared", _shared_memory(self.devices.values()))

    def reserve(self, charges: Mapping[str, int]) -> ClusterView:
        """The view after ``charges`` (bytes per device ref) are placed; devices of nodes that
        are not online are not in the view and need no charge."""
        devices = dict(self.devices)
        for ref, need in charges.items():
            for other in self.sharing(ref):
                d = devices[other]
                if other == ref:
                    devices[other] = replace(d, reserved=d.reserved + need)
                else:
                    devices[other] = replace(d, shared=d.shared + need)
        return ClusterView(devices, self.node_status, self.shared)

    def fits(self, charges: Mapping[str, int]) -> bool:
        """Whether ``charges`` fit what is usable, devices that share memory together."""
        return not self.overfull(charges)

    def overfull(self, charges: Mapping[str, int]) -> list[str]:
        """The devices that ``charges`` would take past what is usable."""
        after = self.reserve(charges)
        touched = {other for ref in charges for other in self.sharing(ref)}
        return [ref for ref in self.devices if ref in touched and after.devices[ref].usable < 0]

    def sharing(self, ref: str) -> tuple[str, ...]:
        """``ref`` and the devices whose memory is the same as its (none when it is gone)."""
        if ref not in self.devices:
            return ()
        assert self.shared is not None
        return self.shared.get(ref, (ref,))

    def release(self, charges: Mapping[str, int]) -> ClusterView:
        """The view after shards with ``charges`` are gone (an instance placed again)."""
        return self.reserve({ref: -need for ref, need in charges.items()})

    def devices_of(self, node_id: str) -> list[Device]:
        return [d for d in self.devices.values() if d.node_id == node_id]

    def on_node(self, node_id: str) -> ClusterView:
        """The view with the devices of one node only (a model whose weights only it has)."""
        devices = {ref: d for ref, d in self.devices.items() if d.node_id == node_id}
        return ClusterView(devices, self.node_status)


def _shared_memory(devices: Iterable[Device]) -> dict[str, tuple[str, ...]]:
    pools: dict[str, list[str]] = {}
    unified: set[str] = set()
    for d in devices:
        if d.kind == "cpu" or d.shares_ram:
            pools.setdefault(d.node_id, []).append(d.ref)
        if d.shares_ram:
            unified.add(d.node_id)
    return {ref: tuple(pools[n]) for n in unified for ref in pools[n]}


def shard_needs(state: ClusterState, runner: RunnerRow) -> dict[str, int]:
    """Memory the runner of this shard needs on each device of its node (nothing when its
    model is unknown): a KV cache for each of its slots, as many as it said it serves, else as
    many as it was placed with; the engine's working memory on each device it uses."""
    inst = state.instance(runner.instance_id)
    model = state.model(inst.model_id) if inst is not None else None
    if inst is None or model is None:
        return {}
    ctx = context_for(model.context_length, inst.context_length, inst.role)
    slots = runner.slots or inst.slots or 1
    fp = Footprint.of(model).with_kv_cache(inst.kv_cache)
    if not runner.devices:
        layers = runner.end_layer - runner.start_layer
        return {f"{runner.node_id}:{runner.device}": fp.need_bytes(ctx, layers, slots)}
    needs: dict[str, int] = {}
    for part in runner.devices:  # the row's JSON of ShardAssignment.devices
        ref = f"{runner.node_id}:{part['device']}"
        needs[ref] = needs.get(ref, 0) + fp.need_bytes(ctx, part["layers"], slots)
    return needs


def device_layers(shard: ShardAssignment) -> list[tuple[str, int]]:
    """The devices of a shard's node and the layers each holds, in layer order."""
    return shard.device_layers()


def charges_of(state: ClusterState, runners: Iterable[RunnerRow]) -> dict[str, int]:
    """Bytes per 'node:device' that these runners hold, counting only instances that hold
    memory (placed, or being deleted)."""
    charges: dict[str, int] = {}
    for row in runners:
        inst = state.instance(row.instance_id)
        if inst is None or inst.status not in HOLDING:
            continue
        for ref, need in shard_needs(state, row).items():
            charges[ref] = charges.get(ref, 0) + need
    return charges


def cluster_view(state: ClusterState, excluding_instance: str | None = None) -> ClusterView:
    """The view of ``state``; the shards of ``excluding_instance`` are not counted (it is the
    one being placed again)."""
    node_status: dict[str, str] = {}
    offered: dict[str, int] = {}
    for node in state.nodes():
        node_status[node.node_id] = node.status
        if node.status == "online":
            offered[node.node_id] = node.memory_offered
    rows = [row for row in state.devices() if row.node_id in offered]
    holding = [row for row in state.runners() if row.instance_id != excluding_instance]
    charges = charges_of(state, holding)
    # What lands on each device's memory, found before the devices are made: made once each
    # (``replace`` per charge took most of a large cluster's view).
    pools: dict[str, list[str]] = {}
    for row in rows:
        if row.unified or row.kind == "cpu":
            pools.setdefault(row.node_id, []).append(f"{row.node_id}:{row.device}")
    pooled = {row.node_id for row in rows if row.unified}
    devices: dict[str, Device] = {}
    for row in rows:
        ref = f"{row.node_id}:{row.device}"
        capacity = offered[row.node_id] if row.kind == "cpu" else row.memory_total
        engines = frozenset(row.engines) if row.engines is not None else None
        ram = offered[row.node_id] if row.unified else None
        shared = 0
        if row.node_id in pooled and ref in pools[row.node_id]:
            shared = sum(charges.get(other, 0) for other in pools[row.node_id] if other != ref)
        devices[ref] = Device(
            row.node_id,
            row.device,
            row.kind,
            capacity,
            charges.get(ref, 0),
            row.backend,
            row.unified,
            engines,
            ram,
            shared,
        )
    return ClusterView(devices, node_status)
