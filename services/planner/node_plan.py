"""How one node can hold a whole replica: the ways its devices share the model's layers.

Pure. Each way is a ``Stage`` (one shard, one runner) with a shape, best first:

0. one accelerator holds it;
1. several accelerators of one backend hold it together, layers in proportion to each one's
   room (llama.cpp's ``tensor_split``);
2. the node's accelerators hold as many layers as fit, the rest stay in RAM (llama.cpp's
   ``n_gpu_layers`` less than the model's layers; it keeps the first layers on the CPU);
3. the CPU (RAM) holds it.

Shapes 1 and 2 are llama.cpp's (``engine_devices``), and only for accelerators with memory of
their own: one that shares the node's RAM gains nothing from spilling into the same RAM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from events.kinds import Engine
from services.models.footprint import Footprint
from services.planner.cluster import Device
from services.planner.engine_devices import ENGINE_DEVICES
from services.planner.layers import split_layers

ONE_GPU, GPUS, GPUS_AND_CPU, CPU = 0, 1, 2, 3


@dataclass(frozen=True)
class Stage:
    """One shard: devices of one node and the layers each holds, in layer order (the CPU's
    first: llama.cpp keeps the first layers in RAM and offloads the last)."""

    parts: tuple[tuple[Device, int], ...]

    @property
    def node_id(self) -> str:
        return self.parts[0][0].node_id

    @property
    def layers(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def main(self) -> Device:
        """The device the shard is named by: its first accelerator, else its only device."""
        return next((d for d, _ in self.parts if d.is_accelerator), self.parts[0][0])

    @property
    def refs(self) -> list[str]:
        return [d.ref for d, _ in self.parts]

    def charges(self, fp: Footprint, tokens: int) -> dict[str, int]:
        """Bytes on each device: its layers' weights and KV cache, and the engine's working
        memory (compute buffers) on every device it uses."""
        return {d.ref: fp.need_bytes(tokens, n) for d, n in self.parts}


# One replica's stages in rank order (one: a whole model on one node).
Stages = list[Stage]


def one_device(device: Device, layers: int) -> Stage:
    return Stage(((device, layers),))


@dataclass(frozen=True)
class Option:
    stage: Stage
    shape: int  # ONE_GPU, GPUS, GPUS_AND_CPU or CPU

    @property
    def cpu_layers(self) -> int:
        return sum(n for d, n in self.stage.parts if not d.is_accelerator)

    def key(self) -> tuple[int, int, int, int, str]:
        """Best first: the shape, fewer layers in RAM, fewer devices, the most room."""
        main = self.stage.main
        return (self.shape, self.cpu_layers, len(self.stage.parts), -main.usable, main.ref)


def layers_that_fit(fp: Footprint, tokens: int, usable: int) -> int:
    """The most layers (0 to all) whose weights, KV cache and engine memory fit ``usable``."""
    room = usable - fp.overhead_bytes
    body = fp.need_bytes(tokens) - fp.overhead_bytes
    if room <= 0:
        return 0
    k = fp.n_layers if body <= 0 else min(fp.n_layers, room * fp.n_layers // body)
    while k > 0 and fp.need_bytes(tokens, k) > usable:
        k -= 1  # need_bytes rounds a share up
    return k


def shared_options(
    accelerators: Sequence[Device], cpu: Device | None, fp: Footprint, tokens: int, engine: Engine
) -> list[Option]:
    """The ways one node's ``accelerators`` (each able to run ``engine``) hold the whole model
    together, or with its ``cpu``: shapes GPUS and GPUS_AND_CPU. (One accelerator or the CPU
    alone is a comparison of each device's room, which placement makes over all nodes at
    once.)"""
    can = ENGINE_DEVICES[engine]
    options: list[Option] = []
    for group in _by_backend(d for d in accelerators if not d.shares_ram):
        if can.several_gpus and len(group) > 1:
            stage = _together(group, fp, tokens)
            if stage is not None:
                options.append(Option(stage, GPUS))
        if can.cpu_spill and cpu is not None:
            stage = _with_cpu(group, cpu, fp, tokens, several=can.several_gpus)
            if stage is not None:
                options.append(Option(stage, GPUS_AND_CPU))
    return options


def _by_backend(devices: Iterable[Device]) -> list[list[Device]]:
    """Accelerators grouped by backend (a runner uses one), the roomiest first in each."""
    groups: dict[str, list[Device]] = {}
    for d in devices:
        groups.setdefault(d.backend or "", []).append(d)
    return [sorted(groups[b], key=lambda d: (-d.usable, d.ref)) for b in sorted(groups)]


def _together(group: list[Device], fp: Footprint, tokens: int) -> Stage | None:
    """The fewest of ``group`` (the roomiest first) that hold the model between them, layers in
    proportion to each one's room less the engine's memory."""
    for k in range(2, min(len(group), fp.n_layers) + 1):
        chosen = group[:k]
        rooms = [d.usable - fp.overhead_bytes for d in chosen]
        if min(rooms) <= 0:
            return None  # the roomiest first: a device without room ends the search
        layers = split_layers(fp.n_layers, rooms)
        if all(fp.need_bytes(tokens, n) <= d.usable for d, n in zip(chosen, layers, strict=True)):
            return Stage(tuple(zip(chosen, layers, strict=True)))
    return None


def _with_cpu(
    group: list[Device], cpu: Device, fp: Footprint, tokens: int, *, several: bool
) -> Stage | None:
    """As many layers as fit on ``group`` (its roomiest only, unless ``several``), the others
    on ``cpu``; None when no accelerator takes a layer or the CPU cannot take the rest."""
    taken: list[tuple[Device, int]] = []
    left = fp.n_layers - 1  # at least one in RAM: all of them is shape ONE_GPU or GPUS
    for d in group if several else group[:1]:
        k = min(layers_that_fit(fp, tokens, d.usable), left)
        if k > 0:
            taken.append((d, k))
            left -= k
    on_cpu = fp.n_layers - sum(k for _, k in taken)
    if not taken or fp.need_bytes(tokens, on_cpu) > cpu.usable:
        return None
    return Stage(((cpu, on_cpu), *taken))
