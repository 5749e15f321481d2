"""Manual placement: the devices a placement spec (``placement_spec.py``) lists, split by its
``tensor_split`` (or by room when it is absent), checked against the live cluster."""

from __future__ import annotations

from collections.abc import Sequence

from events.kinds import Engine
from services.models.footprint import Footprint
from services.planner.cluster import ClusterView, Device
from services.planner.engine_devices import ENGINE_DEVICES
from services.planner.layers import split_layers
from services.planner.node_plan import Stage, Stages
from services.planner.placed import Placed, Rejection, charges_of
from services.planner.placement_spec import DeviceRef
from services.planner.placement_why import gib


def place_by_spec(
    view: ClusterView,
    fp: Footprint,
    tokens: int,
    refs: Sequence[DeviceRef],
    weights: Sequence[float] | None,
    avoid: frozenset[str],
    engine: Engine,
) -> Placed | Rejection:
    devices: list[Device] = []
    for ref in refs:
        device = live_device(view, ref)
        if isinstance(device, Rejection):
            return device
        if device.ref in avoid:
            return Rejection(f"runners of this instance kept failing on {device.ref}")
        if not device.runs(engine):
            runs = ", ".join(sorted(device.engines or ())) or "no engine of its node can use it"
            return Rejection(f"{device.ref} does not run the {engine} engine ({runs})")
        devices.append(device)
    if len(devices) > fp.n_layers:
        return Rejection(f"{len(devices)} devices for a model of {fp.n_layers} layers")
    by_room = weights is None
    if weights is None:
        # Without tensor_split, by the room each device has for layers (as automatic does).
        weights = [max(d.usable - fp.overhead_bytes, 1) for d in devices]
    stages = spec_stages(devices, split_layers(fp.n_layers, weights), engine)
    if isinstance(stages, Rejection):
        return stages
    charges = charges_of([stages], fp, tokens)
    overfull = set(view.overfull(charges))
    for stage in stages:
        for device, n in stage.parts:
            if device.ref in overfull:
                need = sum(charges.get(ref, 0) for ref in view.sharing(device.ref))
                share = "the whole model" if n == fp.n_layers else f"{n} of {fp.n_layers} layers"
                return Rejection(
                    f"{device.ref}: its share ({share}) needs {gib(need)} but"
                    f" {gib(max(device.usable, 0))} is usable there",
                    needed_bytes=need,
                    available_bytes={device.ref: max(device.usable, 0)},
                )
    how = "each device's usable memory" if by_room else "the spec's tensor_split"
    return Placed(stages, f"as the placement spec asks, layers in proportion to {how}")


def spec_stages(devices: list[Device], layers: list[int], engine: Engine) -> Stages | Rejection:
    """The stages a spec's devices make: a node's devices (listed together) are one runner,
    its CPU's layers first; each node is a stage of a pipeline, in the order listed."""
    groups: list[list[tuple[Device, int]]] = []
    for device, n in zip(devices, layers, strict=True):
        if groups and groups[-1][0][0].node_id == device.node_id:
            groups[-1].append((device, n))
        elif any(g[0][0].node_id == device.node_id for g in groups):
            return Rejection(
                f"the devices of node {device.node_id!r} must be listed together: they make"
                " one runner"
            )
        else:
            groups.append([(device, n)])
    can = ENGINE_DEVICES[engine]
    stages: Stages = []
    for rank, group in enumerate(groups):
        group.sort(key=lambda part: part[0].is_accelerator)  # the CPU's layers first
        refs = ", ".join(d.ref for d, _ in group)
        accelerators = [d for d, _ in group if d.is_accelerator]
        if len(group) > 1 and not (can.several_gpus or can.cpu_spill):
            return Rejection(f"the {engine} engine runs a shard on one device, not {refs}")
        if len({d.backend for d in accelerators}) > 1:
            return Rejection(f"{refs} are of different backends: a runner uses one")
        if len(groups) > 1 and not can.accelerated_head:
            if rank == 0 and accelerators:
                return Rejection(
                    f"the first stage of a {engine} pipeline keeps its layers in RAM: give"
                    f" {group[0][0].node_id}:cpu as its device, not {refs}"
                )
            if rank > 0 and len(group) > 1:
                return Rejection(
                    f"a later stage of a {engine} pipeline serves one device: one of {refs}"
                )
        stages.append(Stage(tuple(group)))
    return stages


def live_device(view: ClusterView, ref: DeviceRef) -> Device | Rejection:
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
