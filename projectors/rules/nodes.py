"""Nodes and their devices: joining, leaving, timing out, and each profile's devices."""

from __future__ import annotations

from dataclasses import replace

from events.catalogue import (
    NodeJoined,
    NodeLeft,
    NodeTimedOut,
    ResourceProfiled,
)
from events.records import NodeProfile
from events.states import NodeStatus
from projectors.rows import (
    DeviceRow,
    NodeRow,
)
from projectors.state import Change, ClusterState, Delete, Put


def node_joined(state: ClusterState, e: NodeJoined) -> list[Change]:
    old = state.node(e.node_id) or NodeRow(node_id=e.node_id, status="online")
    row = replace(
        old,
        status="online",
        hostname=e.hostname,
        addresses=list(e.addresses),
        version=e.version,
        heartbeat_s=e.heartbeat_s,
        advertised=e.advertised,
        advertised_why=e.advertised_why,
        joined_at=e.ts,
        left_at=None,
        last_seen=e.ts,
    )
    return [Put(row)]


def node_left(state: ClusterState, e: NodeLeft) -> list[Change]:
    old = state.node(e.node_id)
    if old is None:
        return []
    return [Put(replace(old, status="left", left_at=e.ts))]


def node_timed_out(state: ClusterState, e: NodeTimedOut) -> list[Change]:
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


def resource_profiled(state: ClusterState, e: ResourceProfiled) -> list[Change]:
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
