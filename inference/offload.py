"""What a runner gives its engine's accelerators: exactly what placement gave its shard. Pure.

A shard's devices (``ShardAssignment.devices``, else its one ``device``) become, for llama.cpp:

- the accelerators its process may see (``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``,
  ``GGML_VK_VISIBLE_DEVICES``): the shard's own, in its order, and none of another backend.
  A runner that saw every GPU would make a context, and hold memory, on cards placement gave
  to other runners; and llama.cpp's device list is then the shard's accelerators, in order;
- ``Llama``'s arguments: all of a model on one accelerator (``split_mode`` none, ``main_gpu``
  0); several, ``tensor_split`` by their layer counts; layers in RAM beside them,
  ``n_gpu_layers`` = the layers on accelerators (llama.cpp keeps the first layers on the CPU,
  and the output layer with them); none, no GPU at all (``main_gpu`` -1 empties llama.cpp's
  device list, so that not even a prompt's matrix products go to a GPU).

Metal and SYCL have no such variable: a Mac has one GPU. MLX runs on its default device, the
GPU for a shard on an accelerator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from events.records import AcceleratorBackend, ShardAssignment
from inference.engines.llamacpp.devices import GgmlDevice, model_devices

# llama.h's enum llama_split_mode (the module stays free of llama_cpp, which is slow to import).
SPLIT_MODE_NONE = 0
SPLIT_MODE_LAYER = 1

# Each backend's variable that lists the devices a process sees, by index.
VISIBLE_DEVICES: dict[AcceleratorBackend, str] = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "rocm": "HIP_VISIBLE_DEVICES",
    "vulkan": "GGML_VK_VISIBLE_DEVICES",
}
# CUDA numbers devices fastest first unless told; NVML, the worker and placement count in PCI
# bus order.
CUDA_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def accelerator_of(device: str) -> tuple[AcceleratorBackend, int] | None:
    """'cuda1' -> ('cuda', 1); 'gpuN' (an NVIDIA GPU as older workers named it) is CUDA's;
    None for the CPU."""
    if device == "cpu":
        return None
    name = device.rstrip("0123456789")
    index = int(device[len(name) :])
    if name == "gpu":
        return ("cuda", index)
    for backend in ("cuda", "rocm", "metal", "vulkan", "sycl"):
        if name == backend:
            return (backend, index)
    raise ValueError(f"unknown device {device!r}")


def accelerators(shard: ShardAssignment) -> list[tuple[AcceleratorBackend, int, int]]:
    """The shard's accelerators in layer order: (backend, index, layers)."""
    found = []
    for device, layers in shard.device_layers():
        acc = accelerator_of(device)
        if acc is not None:
            found.append((*acc, layers))
    return found


def visible_devices(shard: ShardAssignment, inherited: Mapping[str, str]) -> dict[str, str]:
    """The environment that shows the runner's process its shard's accelerators only. A list
    the worker itself was given (``CUDA_VISIBLE_DEVICES=2,3``) is what the indices count in."""
    env = dict(CUDA_ORDER)
    used = accelerators(shard)
    for backend, variable in VISIBLE_DEVICES.items():
        indices = [index for b, index, _ in used if b == backend]
        given = inherited.get(variable)
        if given is not None and given.strip():
            tokens = [t.strip() for t in given.split(",")]
            env[variable] = ",".join(tokens[i] for i in indices if i < len(tokens))
        else:
            env[variable] = ",".join(str(i) for i in indices)
    return env


def llama_offload(shard: ShardAssignment) -> dict[str, Any]:
    """``Llama``'s arguments for a whole model's shard, its process seeing only its
    accelerators (``visible_devices``), in the shard's order."""
    used = accelerators(shard)
    in_ram = sum(n for device, n in shard.device_layers() if device == "cpu")
    if not used:
        return {"n_gpu_layers": 0, "split_mode": SPLIT_MODE_NONE, "main_gpu": -1}
    if len(used) == 1 and not in_ram:
        # n_layers + 1: every layer and the output layer.
        return {"n_gpu_layers": shard.n_layers + 1, "split_mode": SPLIT_MODE_NONE, "main_gpu": 0}
    counts = [n for _, _, n in used]
    if not in_ram:
        counts[-1] += 1  # the output layer goes with the last accelerator's layers
    return {
        # llama.cpp offloads the last n_gpu_layers and deals them out by tensor_split in
        # order: with the layer counts as weights, each accelerator gets exactly its own.
        "n_gpu_layers": sum(counts),
        "split_mode": SPLIT_MODE_LAYER,
        "main_gpu": 0,
        "tensor_split": [float(c) for c in counts],
    }


def offload_problem(shard: ShardAssignment, listed: Sequence[GgmlDevice]) -> str | None:
    """Why llama.cpp, listing ``listed`` (after ``visible_devices``), cannot run the shard
    as placed; None when its devices are the shard's accelerators."""
    used = accelerators(shard)
    if not used:
        return None
    wanted = [f"{b}{i}" for b, i, _ in used]
    found = [d for d in model_devices(listed) if d.registry != "RPC"]
    backends = {b for b, _, _ in used}
    if len(found) != len(used) or any(d.backend not in backends for d in found):
        names = ", ".join(d.name for d in found) or "none"
        return (
            f"placed on {', '.join(wanted)}, but llama.cpp here offers {names}: was it built"
            f" for {'/'.join(sorted(backends))}? (`make up` says which accelerator it builds"
            " for; SHOAL_LLAMA_CMAKE_ARGS chooses)"
        )
    return None


def mlx_device(shard: ShardAssignment) -> Literal["gpu", "cpu"]:
    """MLX's default device for the shard: the GPU (Metal, or MLX's CUDA) when placed on an
    accelerator."""
    return "gpu" if accelerators(shard) else "cpu"
