"""Which accelerator `make` builds llama.cpp (llama-cpp-python's compile) for, and its CMake
arguments. Standard library only: `make` runs it before the virtual environment exists.

    python3 scripts/llamacpp_build.py             # 'cuda -DGGML_CUDA=on ...'
    python3 scripts/llamacpp_build.py --explain   # which, and why
    python3 scripts/llamacpp_build.py --check .venv/.installed-llama --args ARGS

- Metal on macOS (llama.cpp's own default there).
- CUDA where ``nvcc`` is found and a usable NVIDIA GPU with it: ``nvidia-smi -L`` lists one,
  or the driver's ``/dev/nvidia0`` is there. ``nvcc`` alone is not enough: a CUDA toolkit is
  often installed where no GPU or driver is (a CI machine, a container), and a CUDA build takes
  long there and then cannot load without ``libcuda``. The architectures are the GPUs' own
  compute capabilities (``nvidia-smi --query-gpu=compute_cap``), so that nvcc builds for
  those only.
- Vulkan where its SDK is (``glslc`` and the Vulkan headers, or ``VULKAN_SDK``) and a GPU
  (``/dev/dri/renderD*``).
- Otherwise the CPU.

``SHOAL_LLAMA_CMAKE_ARGS`` (the Makefile's) replaces what is chosen here.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Accelerator = Literal["metal", "cuda", "vulkan", "cpu"]
# What every build has (the Makefile's CMAKE_ARGS before the accelerator's).
BASE_ARGS = ("-DGGML_RPC=on", "-DGGML_NATIVE=off")


@dataclass(frozen=True)
class Evidence:
    """What the machine shows of its accelerators and toolkits."""

    system: str  # platform.system()
    nvcc: str | None = None  # its path
    nvidia_gpus: tuple[str, ...] = ()  # `nvidia-smi -L` lines; none when it fails or is absent
    compute_caps: tuple[str, ...] = ()  # '9.0', one per GPU
    nvidia_device: bool = False  # /dev/nvidia0
    vulkan_sdk: str | None = None  # where its headers or SDK are, with glslc on the PATH
    render_node: bool = False  # /dev/dri/renderD*


@dataclass(frozen=True)
class Choice:
    accelerator: Accelerator
    args: tuple[str, ...] = field(default_factory=tuple)
    why: str = ""


def choose(e: Evidence) -> Choice:
    """The accelerator to build for, its CMake arguments (beyond ``BASE_ARGS``), and why."""
    if e.system == "Darwin":
        return Choice("metal", ("-DGGML_METAL=on",), "macOS: Metal")
    gpu = e.nvidia_gpus or e.nvidia_device
    if e.nvcc and gpu:
        archs = sorted({c.replace(".", "") for c in e.compute_caps if c.strip()})
        args = ["-DGGML_CUDA=on"]
        if archs:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}")
        seen = f"nvidia-smi lists {', '.join(e.nvidia_gpus)}" if e.nvidia_gpus else "/dev/nvidia0"
        return Choice("cuda", tuple(args), f"CUDA: nvcc at {e.nvcc}, and {seen}")
    if e.vulkan_sdk and e.render_node:
        return Choice(
            "vulkan", ("-DGGML_VULKAN=on",), f"Vulkan: its SDK at {e.vulkan_sdk}, and a GPU"
        )
    missing = []
    if e.nvcc:
        missing.append(
            f"nvcc at {e.nvcc} but no usable NVIDIA GPU (nvidia-smi lists none, no /dev/nvidia0)"
        )
    elif gpu:
        missing.append("an NVIDIA GPU but no nvcc (the CUDA toolkit) on the PATH")
    if e.vulkan_sdk and not e.render_node:
        missing.append(f"the Vulkan SDK at {e.vulkan_sdk} but no GPU (/dev/dri/renderD*)")
    return Choice("cpu", (), "the CPU" + (f": {'; '.join(missing)}" if missing else ""))


def gather(
    env: Mapping[str, str] | None = None, root: Path = Path("/"), system: str | None = None
) -> Evidence:
    """What this machine shows. ``env`` (its PATH, VULKAN_SDK), ``root`` and ``system`` let
    tests show it fake tools, devices and systems."""
    env = os.environ if env is None else env
    path = env.get("PATH", "")
    nvcc = shutil.which("nvcc", path=path)
    smi = shutil.which("nvidia-smi", path=path)
    gpus = tuple(line for line in _run([smi, "-L"], env) if line.strip()) if smi else ()
    caps = _run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], env) if gpus else []
    sdk = env.get("VULKAN_SDK") or (
        str(root / "usr/include/vulkan")
        if (root / "usr/include/vulkan/vulkan.h").exists()
        else None
    )
    return Evidence(
        system=system or platform.system(),
        nvcc=nvcc,
        nvidia_gpus=gpus,
        compute_caps=tuple(c.strip() for c in caps if c.strip()),
        nvidia_device=(root / "dev/nvidia0").exists(),
        vulkan_sdk=sdk if sdk and shutil.which("glslc", path=path) else None,
        render_node=any((root / "dev/dri").glob("renderD*"))
        if (root / "dev/dri").is_dir()
        else False,
    )


def _run(command: Sequence[str | None], env: Mapping[str, str]) -> list[str]:
    """The command's output lines; none when it fails (no driver: nvidia-smi exits non-zero)."""
    try:
        out = subprocess.run(
            [str(c) for c in command],
            capture_output=True,
            text=True,
            timeout=20,
            env=dict(env),
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.splitlines()


def built_note(marker: str, args: str, choice: Choice) -> str | None:
    """A note when the llama.cpp in the virtual environment (built with the CMAKE_ARGS its
    marker holds; an empty marker is a build from before accelerators, for the CPU) was built
    for another accelerator than ``args`` ask for now."""
    built = marker.split() or list(BASE_ARGS)
    if sorted(built) == sorted(args.split()):
        return None
    return (
        f"llama.cpp here was built with CMAKE_ARGS={' '.join(built)}, not {args} as `make`"
        f" would build it now (this machine: {choice.why}). To rebuild it (minutes):"
        " rm .venv/.installed-llama && make up"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="say which and why")
    parser.add_argument("--check", metavar="MARKER", help="note if MARKER's build differs")
    parser.add_argument("--args", default="", help="with --check: the CMAKE_ARGS of now")
    options = parser.parse_args(argv)
    choice = choose(gather())
    if options.check is not None:
        marker = Path(options.check)
        note = built_note(marker.read_text() if marker.exists() else "", options.args, choice)
        if note:
            print(note, file=sys.stderr)
    elif options.explain:
        print(f"llama.cpp is built for {choice.why}")
    else:
        print(" ".join([choice.accelerator, *choice.args]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
