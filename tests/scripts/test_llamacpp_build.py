"""Which accelerator `make` builds llama.cpp for: the choice from fake machines (tools on a fake
PATH, devices under a fake root), the note `make up` gives when the built engine differs, and
what a dry run of `make` shows."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from scripts.llamacpp_build import (
    BASE_ARGS,
    Evidence,
    built_note,
    choose,
    gather,
)

ROOT = Path(__file__).parents[2]
H200 = "GPU 0: NVIDIA H200 (UUID: GPU-5e3c1b2a-0000-0000-0000-000000000000)"


def tool(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def machine(
    tmp_path: Path,
    *,
    nvcc: bool = False,
    smi: str | None = None,
    devices: tuple[str, ...] = (),
    glslc: bool = False,
) -> tuple[dict[str, str], Path]:
    """A fake machine: tools in its bin folder (the PATH), files under its root."""
    bin_dir, root = tmp_path / "bin", tmp_path / "root"
    bin_dir.mkdir()
    root.mkdir()
    if nvcc:
        tool(bin_dir, "nvcc", "exit 0")
    if smi is not None:
        tool(bin_dir, "nvidia-smi", smi)
    if glslc:
        tool(bin_dir, "glslc", "exit 0")
    for name in devices:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    return {"PATH": str(bin_dir)}, root


# nvidia-smi without a driver fails, as on this project's CI machine.
NO_DRIVER = 'echo "NVIDIA-SMI has failed because it could not communicate with the driver"; exit 9'
ONE_H200 = f"""case "$1" in
  -L) echo "{H200}" ;;
  --query-gpu=compute_cap) echo "9.0" ;;
esac"""


def test_nvcc_without_a_gpu_builds_for_the_cpu(tmp_path: Path) -> None:
    env, root = machine(tmp_path, nvcc=True, smi=NO_DRIVER)
    evidence = gather(env, root, system="Linux")
    assert evidence.nvcc == str(tmp_path / "bin" / "nvcc") and evidence.nvidia_gpus == ()
    choice = choose(evidence)
    assert (choice.accelerator, choice.args) == ("cpu", ())
    assert "no usable NVIDIA GPU" in choice.why


def test_nvcc_and_a_gpu_nvidia_smi_lists_build_cuda_for_its_architecture(tmp_path: Path) -> None:
    env, root = machine(tmp_path, nvcc=True, smi=ONE_H200)
    choice = choose(gather(env, root, system="Linux"))
    assert choice.accelerator == "cuda"
    assert choice.args == ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90")
    assert H200 in choice.why


def test_the_driver_device_is_evidence_enough_without_nvidia_smi(tmp_path: Path) -> None:
    env, root = machine(tmp_path, nvcc=True, devices=("dev/nvidia0",))
    choice = choose(gather(env, root, system="Linux"))
    assert (choice.accelerator, choice.args) == ("cuda", ("-DGGML_CUDA=on",))


def test_a_gpu_without_nvcc_builds_for_the_cpu(tmp_path: Path) -> None:
    env, root = machine(tmp_path, smi=ONE_H200)
    choice = choose(gather(env, root, system="Linux"))
    assert choice.accelerator == "cpu" and "no nvcc" in choice.why


def test_vulkan_needs_its_sdk_and_a_gpu(tmp_path: Path) -> None:
    sdk = ("usr/include/vulkan/vulkan.h",)
    env, root = machine(tmp_path, glslc=True, devices=(*sdk, "dev/dri/renderD128"))
    assert choose(gather(env, root, system="Linux")).args == ("-DGGML_VULKAN=on",)
    no_gpu = choose(Evidence(system="Linux", vulkan_sdk="/usr/include/vulkan"))
    assert no_gpu.accelerator == "cpu" and "no GPU" in no_gpu.why
    assert choose(Evidence(system="Linux", render_node=True)).accelerator == "cpu"  # no SDK


def test_a_mac_builds_metal_and_cuda_comes_before_vulkan() -> None:
    assert choose(Evidence(system="Darwin")).args == ("-DGGML_METAL=on",)
    caps = ("8.6", "9.0", "8.6")
    both = Evidence("Linux", "/usr/bin/nvcc", (H200,), caps, vulkan_sdk="/sdk", render_node=True)
    assert choose(both).args == ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=86;90")


def test_this_machine_builds_no_cuda_without_a_usable_gpu() -> None:
    # CI runs here: nvcc is installed, but there is no GPU and no driver.
    evidence = gather()
    if not evidence.nvidia_gpus and not evidence.nvidia_device:
        assert choose(evidence).accelerator != "cuda"


def test_make_up_notes_an_engine_built_for_another_accelerator() -> None:
    cuda = Evidence(system="Linux", nvcc="/usr/bin/nvcc", nvidia_gpus=(H200,))
    base = " ".join(BASE_ARGS)
    assert built_note("", base, choose(cuda)) is None  # a marker from before: the CPU
    assert built_note(f"{base}\n", base, choose(cuda)) is None
    note = built_note("", f"{base} -DGGML_CUDA=on", choose(cuda))
    assert note is not None and "rm .venv/.installed-llama && make up" in note


# What an outer make (``make test`` runs this test) exports to its children: a dry run here is
# a user's own, in a shell of their own.
OUTER_MAKE = ("CMAKE_ARGS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def make_dry_run(*targets: str, **env: str) -> str:
    shell = {k: v for k, v in os.environ.items() if k not in OUTER_MAKE}
    out = subprocess.run(
        ["make", "-n", *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**shell, **env},
        check=True,
    )
    return out.stdout


def test_a_dry_run_shows_the_cmake_arguments_it_would_build_with(tmp_path: Path) -> None:
    fresh = make_dry_run(f"VENV={tmp_path / 'venv'}", "up")
    assert "llama.cpp: building for " in fresh
    assert "CMAKE_ARGS='-DGGML_RPC=on -DGGML_NATIVE=off" in fresh
    cuda = "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90"
    chosen = make_dry_run(f"VENV={tmp_path / 'venv'}", "up", SHOAL_LLAMA_CMAKE_ARGS=cuda)
    assert "CMAKE_ARGS='-DGGML_RPC=on -DGGML_NATIVE=off -DGGML_CUDA=on" in chosen


def test_the_existing_environment_is_not_rebuilt() -> None:
    for target in ("up", "test"):
        assert "llama-cpp-python" not in make_dry_run(target)
