"""What the engines on this machine can run on: llama.cpp's registry and MLX's GPU, asked once
when the worker starts, in a process of their own.

Its own process because asking a CUDA device for its memory makes a CUDA context, which holds
hundreds of MiB of the GPU until the process exits (the worker runs for days), and a broken
driver can crash the asker. It is not started where no engine can have an accelerator (no GPU
backend in llama.cpp's libraries, not a Mac, no NVIDIA GPU for MLX's CUDA): a CPU-only
machine pays nothing.

    python -m services.worker.device_probe   # prints the probe as JSON
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from inference.engines.llamacpp.devices import GgmlDevice, lib_dir, list_devices
from services.worker.devices import MlxGpu

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0
# ggml's GPU backends are libraries of their own beside libggml (llama-cpp-python's build).
_GPU_LIBRARIES = ("ggml-cuda", "ggml-hip", "ggml-metal", "ggml-vulkan", "ggml-sycl")
# The worker and its runners ask CUDA for NVML's order (PCI bus), so that 'cuda1' is the same
# card to NVML, to the probe and to a runner.
CUDA_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class Probe(BaseModel):
    model_config = ConfigDict(frozen=True)

    llamacpp: list[GgmlDevice] = []
    mlx: MlxGpu | None = None


def worth_probing(system: str, libraries: Iterable[str], nvidia_gpus: int) -> bool:
    """Whether an engine here may have an accelerator: a Mac (Metal), a GPU backend among
    llama.cpp's libraries, or an NVIDIA GPU (MLX's CUDA backend)."""
    if system == "Darwin" or nvidia_gpus > 0:
        return True
    return any(name.startswith(f"lib{gpu}") for name in libraries for gpu in _GPU_LIBRARIES)


def llama_libraries() -> list[str]:
    """The file names in llama-cpp-python's library folder (none when it is not installed)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return []
    folder = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(spec.origin).parent / "lib")
    return sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []


async def probe(nvidia_gpus: int) -> Probe:
    """Ask the engines, in a process of their own, when they may have an accelerator; an empty
    probe otherwise, or when the probe fails (logged: the node then offers its CPU)."""
    if not worth_probing(platform.system(), llama_libraries(), nvidia_gpus):
        return Probe()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.worker.device_probe",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **CUDA_ORDER},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), PROBE_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("accelerators not profiled: the probe took over %.0f s", PROBE_TIMEOUT_S)
        return Probe()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        log.warning("accelerators not profiled: the probe exited %s: %s", proc.returncode, tail[0])
        return Probe()
    return Probe.model_validate_json(out)


def _mlx_gpu() -> MlxGpu | None:
    """MLX's GPU: Metal on Apple silicon, or its CUDA backend where installed."""
    if importlib.util.find_spec("mlx") is None:
        return None
    import mlx.core as mx

    if mx.metal.is_available():
        info = mx.device_info()
        return MlxGpu(
            backend="metal",
            name=str(info.get("device_name", "Apple GPU")),
            memory_total=int(info.get("max_recommended_working_set_size", 0)),
            unified=True,
        )
    if mx.cuda.is_available():
        info = mx.device_info()
        return MlxGpu(
            backend="cuda",
            name=str(info.get("device_name", "")),
            memory_total=int(info.get("memory_size", 0)),
        )
    return None


def main() -> None:
    os.environ.update(CUDA_ORDER)
    llamacpp: list[GgmlDevice] = []
    if importlib.util.find_spec("llama_cpp") is not None and lib_dir().is_dir():
        llamacpp = list_devices()
    print(Probe(llamacpp=llamacpp, mlx=_mlx_gpu()).model_dump_json())


if __name__ == "__main__":
    main()
