"""llama.cpp's devices, as its backend registry lists them (ggml's ``ggml_backend_dev_*``),
through ctypes: llama-cpp-python binds none of these functions.

The functions are called on the libraries libllama is linked with (the installed package's,
or ``LLAMA_CPP_LIB_PATH``'s): a second copy of ggml would have a registry of its own. Listing a
CUDA device's memory makes a CUDA context in the calling process, which holds GPU memory until
it exits: the worker lists devices in a short-lived process (``services.worker.device_probe``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict

from events.records import AcceleratorBackend

# enum ggml_backend_dev_type (ggml-backend.h), in order.
GgmlDeviceType = Literal["cpu", "gpu", "igpu", "accel", "meta"]
_TYPES: tuple[GgmlDeviceType, ...] = ("cpu", "gpu", "igpu", "accel", "meta")

# A backend registry's name -> the backend an accelerator is named by. ggml's HIP backend calls
# itself ROCm; its Metal backend MTL (Metal in older versions).
_BACKENDS: dict[str, AcceleratorBackend] = {
    "CUDA": "cuda",
    "ROCm": "rocm",
    "HIP": "rocm",
    "MTL": "metal",
    "Metal": "metal",
    "Vulkan": "vulkan",
    "SYCL": "sycl",
}


class GgmlDevice(BaseModel):
    """One device of llama.cpp's registry."""

    model_config = ConfigDict(frozen=True)

    name: str  # 'CUDA0', 'MTL0', 'Vulkan1', 'CPU'
    description: str = ""  # the card's or CPU's name
    registry: str  # its backend registry: 'CUDA', 'MTL', 'Vulkan', 'CPU', 'RPC'...
    index: int  # its position among its registry's devices
    type: GgmlDeviceType
    memory_free: int = 0
    memory_total: int = 0
    device_id: str | None = None  # a PCI device's bus id, '0000:c1:00.0'

    @property
    def backend(self) -> AcceleratorBackend | None:
        """The accelerator backend it belongs to; None for the CPU, BLAS, RPC..."""
        if self.type not in ("gpu", "igpu"):
            return None
        return _BACKENDS.get(self.registry)

    @property
    def accelerator(self) -> str | None:
        """Its name as Shoal's devices are named: 'cuda0', 'metal0'; None when not one."""
        backend = self.backend
        return None if backend is None else f"{backend}{self.index}"


def model_devices(devices: Sequence[GgmlDevice]) -> list[GgmlDevice]:
    """The devices llama.cpp loads a model onto, in its order (``llama_prepare_model_devices``
    when ``devices`` is not given): RPC servers first, then GPUs (one per PCI device: a GPU two
    backends list is used by the first), then integrated GPUs only when there is no discrete
    one. ``tensor_split`` and ``main_gpu`` count in this order."""
    rpc = [d for d in devices if d.type == "gpu" and d.registry == "RPC"]
    gpus: list[GgmlDevice] = []
    for d in devices:
        if d.type != "gpu" or d.registry == "RPC":
            continue
        if d.device_id and any(g.device_id == d.device_id for g in gpus):
            continue
        gpus.append(d)
    igpus: list[GgmlDevice] = []
    for d in devices:
        if d.type == "igpu" and (not igpus or igpus[-1].registry == d.registry):
            igpus.append(d)
    return [*rpc, *gpus, *([] if gpus else igpus)]


# --- the registry, through ctypes -----------------------------------------------------------


_CAPS = ("async_", "host_buffer", "buffer_from_host_ptr", "events", "mmap_support")


class _Caps(ctypes.Structure):
    _fields_ = [(name, ctypes.c_bool) for name in _CAPS]


class _Props(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", _Caps),
    ]


def lib_dir() -> Path:
    """Where llama-cpp-python loads libllama and its ggml from."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


@cache
def _ggml() -> ctypes.CDLL:
    import llama_cpp  # noqa: F401  (loads libllama, and with it the ggml it is linked with)

    folder = lib_dir()
    for name in ("libggml.so.0", "libggml.so", "libggml.0.dylib", "libggml.dylib", "ggml.dll"):
        if (folder / name).exists():
            lib = ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
            break
    else:
        raise FileNotFoundError(f"no libggml in {folder}")
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get_props.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Props)]
    lib.ggml_backend_dev_get_props.restype = None
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    return lib


def list_devices() -> list[GgmlDevice]:
    """Every device in llama.cpp's registry, in its order (the CPU's among them)."""
    lib = _ggml()
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        props = _Props()
        lib.ggml_backend_dev_get_props(dev, ctypes.byref(props))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        index = next(
            k
            for k in range(lib.ggml_backend_reg_dev_count(reg))
            if lib.ggml_backend_reg_dev_get(reg, k) == dev
        )
        kind = _TYPES[props.type] if 0 <= props.type < len(_TYPES) else "accel"
        devices.append(
            GgmlDevice(
                name=_text(props.name),
                description=_text(props.description),
                registry=_text(lib.ggml_backend_reg_name(reg)),
                index=index,
                type=cast(GgmlDeviceType, kind),
                memory_free=int(props.memory_free),
                memory_total=int(props.memory_total),
                device_id=_text(props.device_id) or None,
            )
        )
    return devices


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value else ""
