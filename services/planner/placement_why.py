"""Why placement put a replica where it did, and why it could not: the words the preview and
the placement events carry, for people."""

from __future__ import annotations

from collections.abc import Sequence

from events.kinds import Engine
from events.units import MiB
from services.models.footprint import Footprint
from services.planner.cluster import ClusterView, Device
from services.planner.engine_devices import ENGINE_DEVICES
from services.planner.node_plan import CPU, GPUS, GPUS_AND_CPU, ONE_GPU, Option, Stages


def why_node(
    best: Option,
    gpu_holds_it: bool,
    view: ClusterView,
    fp: Footprint,
    tokens: int,
    engine: Engine,
    avoid: frozenset[str],
) -> str:
    """Why a replica went to one node in the way it did, for people. ``gpu_holds_it``: some
    GPU (used by another replica, when this one went elsewhere) holds the whole model."""
    need = gib(fp.need_bytes(tokens))
    stage = best.stage
    gpus = [(d, n) for d, n in stage.parts if d.is_accelerator]
    if best.shape == ONE_GPU:
        d = stage.main
        return f"one GPU holds it: {d.ref} has {gib(d.usable)} usable for its {need}"
    if best.shape == GPUS:
        rooms = ", ".join(f"{d.ref} {gib(d.usable)}" for d, _ in gpus)
        why = (
            f"{len(gpus)} GPUs of {stage.node_id} hold its {need}: layers in proportion to"
            f" their usable memory ({rooms})"
        )
    elif best.shape == GPUS_AND_CPU:
        held = ", ".join(f"{d.ref} {n}" for d, n in gpus)
        why = (
            f"as many of its layers as fit go on {stage.node_id}'s"
            f" {'GPUs' if len(gpus) > 1 else 'GPU'} ({held}), the other {best.cpu_layers} stay"
            f" in RAM ({need} in all)"
        )
    else:
        cpu = stage.main
        why = f"in RAM: {cpu.ref} has {gib(cpu.usable)} usable for its {need}"
    if gpu_holds_it:
        return why + "; the GPUs that hold it alone serve other replicas"
    if best.shape == CPU:
        return why + "; " + no_gpu(view, engine, avoid, fp, tokens)
    alone = "GPU" if best.shape == GPUS else "GPU or GPUs of a node"
    return f"no {alone} holds it: {why}"


def no_gpu(
    view: ClusterView, engine: Engine, avoid: frozenset[str], fp: Footprint, tokens: int
) -> str:
    """Why no accelerator took a replica that went to a CPU."""
    gpus = [d for d in view.devices.values() if d.is_accelerator and d.ref not in avoid]
    if not gpus:
        return "no GPU is online"
    runs = [d for d in gpus if d.runs(engine)]
    if not runs:
        seen = ", ".join(sorted(d.ref for d in gpus)[:4])
        return f"no GPU online runs {engine} ({seen}: its engine was built without their backend)"
    roomiest = max(runs, key=lambda d: (d.usable, d.ref))
    if ENGINE_DEVICES[engine].cpu_spill:
        return (
            f"no GPU takes a layer beside a CPU that takes the rest (the roomiest,"
            f" {roomiest.ref}, has {gib(max(roomiest.usable, 0))} usable)"
        )
    return f"no GPU holds it (the roomiest, {roomiest.ref}, has {gib(max(roomiest.usable, 0))})"


def why_split(
    stages: Stages, fp: Footprint, tokens: int, engine: Engine, candidates: Sequence[Device]
) -> str:
    roomiest = max(candidates, key=lambda d: (d.usable, d.ref))
    rooms = ", ".join(f"{s.main.ref} {gib(s.main.usable)}" for s in stages)
    why = (
        f"no node holds its {gib(fp.need_bytes(tokens))} (the roomiest device, {roomiest.ref},"
        f" has {gib(max(roomiest.usable, 0))} usable): split over {len(stages)} nodes, layers"
        f" in proportion to each one's room ({rooms})"
    )
    if not ENGINE_DEVICES[engine].accelerated_head:
        why += f"; the head keeps its layers in RAM, as a {engine} pipeline's head does"
    return why


def gib(n: int) -> str:
    """Bytes for people: GiB with two decimals, MiB below one GiB."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / MiB:.0f} MiB"
