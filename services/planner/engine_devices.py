"""What each engine can do with the devices of a node, for placement.

- llama.cpp runs one model on several GPUs of a node in one process (its ``tensor_split``),
  and keeps the layers that do not fit them on the CPU (``n_gpu_layers`` less than the model's
  layers). A pipeline's head keeps its own layers in RAM: llama-cpp-python's ``Llama`` lists
  the later stages' RPC devices before local GPUs, and layers go to devices in that order.
  A later stage serves one device over RPC.
- MLX runs a process on one device, its default (``mx.gpu`` or ``mx.cpu``), whole model or
  ring rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from events.kinds import Engine


@dataclass(frozen=True)
class EngineDevices:
    several_gpus: bool  # one runner across several accelerators of its node
    cpu_spill: bool  # one runner with some layers on accelerators and the rest on the CPU
    accelerated_head: bool  # a pipeline's first stage may hold its layers on an accelerator


ENGINE_DEVICES: dict[Engine, EngineDevices] = {
    "llamacpp": EngineDevices(several_gpus=True, cpu_spill=True, accelerated_head=False),
    "mlx": EngineDevices(several_gpus=False, cpu_spill=False, accelerated_head=True),
    # A diffusers pipeline runs whole on one device (never split: it is one layer to placement).
    "diffusers": EngineDevices(several_gpus=False, cpu_spill=False, accelerated_head=True),
}
