"""The cluster as placement sees it: the devices of online nodes and the memory left on each.

A pure function of the projection. A device's usable memory is what its node offers (RAM for
``cpu``, the card's memory for ``gpuN``) less a 10% headroom, less what the shards already
placed there need. Offered memory excludes nothing Shoal itself uses (the worker adds its own
runners back), so a placed shard is counted once, here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from projectors.rows import RunnerRow
from projectors.state import ClusterState
from services.models.footprint import Footprint, context_for

HEADROOM = 0.10
# Instances whose runners hold memory: placed ones, and ones being deleted until they are.
HOLDING = frozenset({"placed", "deleting"})


@dataclass(frozen=True, slots=True)
class Device:
    node_id: str
    device: str  # 'cpu' or 'gpuN'
    kind: str  # 'cpu' or 'gpu'
    capacity: int  # bytes the node offers on this device
    reserved: int = 0  # bytes that shards placed here need

    @property
    def ref(self) -> str:
        return f"{self.node_id}:{self.device}"

    @property
    def usable(self) -> int:
        return int(self.capacity * (1 - HEADROOM)) - self.reserved


@dataclass(frozen=True)
class ClusterView:
    devices: Mapping[str, Device]  # by ref ('node:device'), online nodes only
    node_status: Mapping[str, str]  # every known node: online | left | timed_out

    def reserve(self, charges: Mapping[str, int]) -> ClusterView:
        """The view after ``charges`` (bytes per device ref) are placed; devices of nodes that
        are not online are not in the view and need no charge."""
        devices = dict(self.devices)
        for ref, need in charges.items():
            if ref in devices:
                devices[ref] = replace(devices[ref], reserved=devices[ref].reserved + need)
        return ClusterView(devices, self.node_status)

    def release(self, charges: Mapping[str, int]) -> ClusterView:
        """The view after shards with ``charges`` are gone (an instance placed again)."""
        return self.reserve({ref: -need for ref, need in charges.items()})

    def devices_of(self, node_id: str) -> list[Device]:
        return [d for d in self.devices.values() if d.node_id == node_id]


def shard_need(state: ClusterState, runner: RunnerRow) -> int:
    """Memory the runner of this shard needs (0 when its model is unknown): a KV cache for
    each of its slots, as many as it said it serves, else as many as it was placed with."""
    inst = state.instance(runner.instance_id)
    model = state.model(inst.model_id) if inst is not None else None
    if inst is None or model is None:
        return 0
    ctx = context_for(model.context_length, inst.context_length, inst.role)
    slots = runner.slots or inst.slots or 1
    return Footprint.of(model).need_bytes(ctx, runner.end_layer - runner.start_layer, slots)


def charges_of(state: ClusterState, runners: Iterable[RunnerRow]) -> dict[str, int]:
    """Bytes per 'node:device' that these runners hold, counting only instances that hold
    memory (placed, or being deleted)."""
    charges: dict[str, int] = {}
    for row in runners:
        inst = state.instance(row.instance_id)
        if inst is None or inst.status not in HOLDING:
            continue
        ref = f"{row.node_id}:{row.device}"
        charges[ref] = charges.get(ref, 0) + shard_need(state, row)
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
    devices: dict[str, Device] = {}
    for row in state.devices():
        if row.node_id not in offered:
            continue
        capacity = offered[row.node_id] if row.kind == "cpu" else row.memory_total
        d = Device(row.node_id, row.device, row.kind, capacity)
        devices[d.ref] = d
    holding = [row for row in state.runners() if row.instance_id != excluding_instance]
    for ref, need in charges_of(state, holding).items():
        if ref in devices:
            devices[ref] = replace(devices[ref], reserved=need)
    return ClusterView(devices, node_status)
