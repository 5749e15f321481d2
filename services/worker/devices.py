"""A node's accelerators, from what each source sees of them. Pure.

- llama.cpp's registry (``GgmlDevice``): the devices llama.cpp can run on, named by backend and
  index ('cuda0', 'vulkan1', 'metal0'). A device two backends list (CUDA and Vulkan both built)
  counts once, under the first, as llama.cpp itself uses it.
- NVML (``NvidiaGpu``): every NVIDIA GPU, its name, compute capability and memory right now.
  Matched to llama.cpp's device by PCI bus id (else by CUDA index: the worker and runners ask
  CUDA for PCI bus order, NVML's); one that llama.cpp does not list is still reported, with no
  engine (llama.cpp built without CUDA, or the GPU hidden from it): seen, not placed on.
- MLX (``MlxGpu``): Apple silicon's GPU (unified memory, its recommended working set), or
  MLX's CUDA backend on the first NVIDIA GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from events.records import Accelerator
from inference.engines.llamacpp.devices import GgmlDevice


class NvidiaGpu(BaseModel):
    """An NVIDIA GPU as NVML sees it."""

    model_config = ConfigDict(frozen=True)

    index: int  # NVML's, which is PCI bus order
    name: str
    memory_total: int
    memory_free: int
    utilisation: float | None = None
    compute_capability: str | None = None  # '9.0'
    pci_bus_id: str | None = None  # as NVML writes it: '00000000:C1:00.0'


class MlxGpu(BaseModel):
    """The GPU MLX runs on (``mx.gpu``), when it has one."""

    model_config = ConfigDict(frozen=True)

    backend: Literal["metal", "cuda"]
    name: str = ""
    memory_total: int  # Metal: the recommended working set; CUDA: the card's memory
    unified: bool = False


def pci_bus_id(text: str | None) -> str | None:
    """A PCI bus id in one form: NVML's '00000000:C1:00.0' and ggml's '0000:c1:00.0' are
    both '0000:c1:00.0'."""
    if not text:
        return None
    try:
        domain, bus, rest = text.strip().lower().rsplit(":", 2)
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{rest}"
    except ValueError:
        return text.strip().lower()


def accelerators(
    ggml: Sequence[GgmlDevice], nvidia: Sequence[NvidiaGpu], mlx: MlxGpu | None
) -> list[Accelerator]:
    """The node's accelerators, each once, in a stable order (llama.cpp's, then the others)."""
    found: list[Accelerator] = []
    ids: list[str | None] = []  # each one's PCI bus id, where known
    for d in ggml:
        backend = d.backend
        bus = pci_bus_id(d.device_id)
        if backend is None or (bus is not None and bus in ids):
            continue
        found.append(
            Accelerator(
                backend=backend,
                index=d.index,
                name=d.description or d.name,
                memory_total=d.memory_total,
                memory_free=d.memory_free,
                unified=d.type == "igpu" or backend == "metal",
                engines=["llamacpp"],
            )
        )
        ids.append(bus)
    for gpu in nvidia:
        bus = pci_bus_id(gpu.pci_bus_id)
        at = _match(found, ids, bus, gpu.index)
        seen = {
            "name": gpu.name,
            "memory_total": gpu.memory_total,
            "memory_free": gpu.memory_free,
            "utilisation": gpu.utilisation,
            "compute_capability": gpu.compute_capability,
        }
        if at is None:  # seen, not usable: no engine; named after llama.cpp's CUDA devices
            taken = {a.index for a in found if a.backend == "cuda"}
            index = gpu.index if gpu.index not in taken else max(taken) + 1
            found.append(Accelerator(backend="cuda", index=index, **seen))
            ids.append(bus)
        else:
            found[at] = found[at].model_copy(update=seen)
    if mlx is not None:
        at = next((i for i, a in enumerate(found) if a.device == f"{mlx.backend}0"), None)
        if at is None:
            found.append(
                Accelerator(
                    backend=mlx.backend,
                    index=0,
                    name=mlx.name,
                    memory_total=mlx.memory_total,
                    unified=mlx.unified,
                    engines=["mlx"],
                )
            )
        else:
            engines = [*found[at].engines, "mlx"]
            found[at] = found[at].model_copy(update={"engines": engines})
    return found


def _match(
    found: list[Accelerator], ids: list[str | None], bus: str | None, index: int
) -> int | None:
    if bus is not None and bus in ids:
        return ids.index(bus)
    # No bus id to go by: CUDA's device of the same index (both in PCI bus order).
    return next(
        (i for i, a in enumerate(found) if a.device == f"cuda{index}" and ids[i] is None), None
    )
