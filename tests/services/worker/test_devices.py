"""A node's accelerators: llama.cpp's registry (for real: the CPU only, here), and what the
worker makes of each source's view, as pure functions over the views of a GPU machine, a
machine with two cards, a Mac and a machine whose llama.cpp was built without CUDA."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from events.records import Accelerator
from events.units import GiB
from inference.engines.llamacpp.devices import GgmlDevice, list_devices, model_devices
from services.worker.device_probe import Probe, probe, worth_probing
from services.worker.devices import MlxGpu, NvidiaGpu, accelerators, pci_bus_id
from services.worker.profile import collect_profile

ROOT = Path(__file__).parents[3]


def ggml(
    name: str,
    registry: str,
    index: int,
    kind: str,
    memory: int,
    bus: str | None = None,
    description: str = "",
) -> GgmlDevice:
    return GgmlDevice.model_validate(
        {
            "name": name,
            "description": description or name,
            "registry": registry,
            "index": index,
            "type": kind,
            "memory_free": memory,
            "memory_total": memory,
            "device_id": bus,
        }
    )


CPU = ggml("CPU", "CPU", 0, "cpu", 64 * GiB)


def nvml(index: int, memory: int, bus: str, name: str = "NVIDIA H100") -> NvidiaGpu:
    return NvidiaGpu(
        index=index,
        name=name,
        memory_total=memory,
        memory_free=memory - GiB,
        utilisation=12.0,
        compute_capability="9.0",
        pci_bus_id=bus,
    )


# --- llama.cpp's registry, for real -------------------------------------------------------------


def test_llamacpps_registry_lists_the_cpu_here_and_no_accelerator() -> None:
    devices = list_devices()
    assert [(d.name, d.registry, d.type) for d in devices] == [("CPU", "CPU", "cpu")]
    assert devices[0].memory_total > 0 and devices[0].accelerator is None
    assert model_devices(devices) == []  # a model here loads on no GPU
    assert accelerators(devices, [], None) == []


def test_the_probe_process_prints_what_it_found() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.worker.device_probe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = Probe.model_validate_json(out.stdout)
    assert [d.name for d in found.llamacpp] == ["CPU"] and found.mlx is None
    assert json.loads(out.stdout)["llamacpp"][0]["type"] == "cpu"


def test_a_cpu_only_machine_is_not_probed_and_profiles_no_accelerator(tmp_path: Path) -> None:
    assert asyncio.run(probe(nvidia_gpus=0)) == Probe()  # no GPU backend built, no NVML GPU
    assert collect_profile(tmp_path, probe=Probe(llamacpp=[CPU])).accelerators == []


def test_which_machines_are_worth_probing() -> None:
    cpu_build = ["libggml-base.so", "libggml-cpu.so", "libggml-rpc.so", "libllama.so"]
    assert not worth_probing("Linux", cpu_build, nvidia_gpus=0)
    assert worth_probing("Linux", [*cpu_build, "libggml-cuda.so"], nvidia_gpus=0)
    assert worth_probing("Linux", [*cpu_build, "libggml-vulkan.so.0"], nvidia_gpus=0)
    assert worth_probing("Linux", cpu_build, nvidia_gpus=1)  # MLX's CUDA backend may run
    assert worth_probing("Darwin", ["libggml-base.dylib"], nvidia_gpus=0)


# --- llama.cpp's order for a model ----------------------------------------------------------------


def test_llamacpps_model_order_is_rpc_then_one_gpu_per_card_then_igpus_only_without_gpus() -> None:
    cuda0 = ggml("CUDA0", "CUDA", 0, "gpu", 24 * GiB, "0000:01:00.0")
    cuda1 = ggml("CUDA1", "CUDA", 1, "gpu", 16 * GiB, "0000:02:00.0")
    vk_same = ggml("Vulkan0", "Vulkan", 0, "gpu", 24 * GiB, "0000:01:00.0")
    igpu = ggml("Vulkan1", "Vulkan", 1, "igpu", 8 * GiB, "0000:00:02.0")
    rpc = ggml("RPC0", "RPC", 0, "gpu", 32 * GiB)
    order = model_devices([CPU, cuda0, cuda1, vk_same, igpu, rpc])
    assert [d.name for d in order] == ["RPC0", "CUDA0", "CUDA1"]
    assert [d.name for d in model_devices([CPU, igpu])] == ["Vulkan1"]
    assert [d.accelerator for d in (cuda1, vk_same, igpu, rpc, CPU)] == [
        "cuda1",
        "vulkan0",
        "vulkan1",
        None,
        None,
    ]


# --- the accelerators a worker reports ------------------------------------------------------------


def test_one_nvidia_gpu_seen_by_llamacpp_and_nvml_is_one_accelerator() -> None:
    llama = [CPU, ggml("CUDA0", "CUDA", 0, "gpu", 80 * GiB, "0000:c1:00.0", "NVIDIA H100")]
    (gpu,) = accelerators(llama, [nvml(0, 80 * GiB, "00000000:C1:00.0")], None)
    assert gpu == Accelerator(
        backend="cuda",
        index=0,
        name="NVIDIA H100",
        memory_total=80 * GiB,
        memory_free=79 * GiB,
        unified=False,
        compute_capability="9.0",
        utilisation=12.0,
        engines=["llamacpp"],
    )
    assert gpu.device == "cuda0"


def test_two_unequal_cards_are_matched_by_pci_bus_id() -> None:
    llama = [
        CPU,
        ggml("CUDA0", "CUDA", 0, "gpu", 24 * GiB, "0000:01:00.0"),
        ggml("CUDA1", "CUDA", 1, "gpu", 16 * GiB, "0000:02:00.0"),
    ]
    seen = [
        nvml(0, 24 * GiB, "00000000:01:00.0", "RTX 4090"),
        nvml(1, 16 * GiB, "00000000:02:00.0", "RTX 4080"),
    ]
    found = accelerators(llama, seen, None)
    assert [(a.device, a.name, a.memory_total, a.engines) for a in found] == [
        ("cuda0", "RTX 4090", 24 * GiB, ["llamacpp"]),
        ("cuda1", "RTX 4080", 16 * GiB, ["llamacpp"]),
    ]


def test_a_gpu_llamacpp_was_built_without_is_reported_with_no_engine() -> None:
    (gpu,) = accelerators([CPU], [nvml(0, 8 * GiB, "00000000:01:00.0", "RTX 3070")], None)
    assert (gpu.device, gpu.name, gpu.engines) == ("cuda0", "RTX 3070", [])


def test_a_gpu_hidden_from_llamacpp_gets_a_name_of_its_own() -> None:
    # CUDA_VISIBLE_DEVICES=1 for the worker: llama.cpp's CUDA0 is NVML's second card.
    llama = [CPU, ggml("CUDA0", "CUDA", 0, "gpu", 16 * GiB, "0000:02:00.0")]
    seen = [nvml(0, 24 * GiB, "00000000:01:00.0"), nvml(1, 16 * GiB, "00000000:02:00.0")]
    found = accelerators(llama, seen, None)
    assert [(a.device, a.memory_total, a.engines) for a in found] == [
        ("cuda0", 16 * GiB, ["llamacpp"]),
        ("cuda1", 24 * GiB, []),
    ]


def test_a_card_two_backends_list_counts_once() -> None:
    llama = [
        CPU,
        ggml("CUDA0", "CUDA", 0, "gpu", 24 * GiB, "0000:01:00.0"),
        ggml("Vulkan0", "Vulkan", 0, "gpu", 24 * GiB, "0000:01:00.0"),
    ]
    assert [a.device for a in accelerators(llama, [], None)] == ["cuda0"]


def test_a_mac_reports_its_gpu_once_for_llamacpp_and_mlx_with_unified_memory() -> None:
    metal = ggml("MTL0", "MTL", 0, "gpu", 21 * GiB, None, "Apple M2 Pro")
    mlx = MlxGpu(backend="metal", name="Apple M2 Pro", memory_total=21 * GiB, unified=True)
    (gpu,) = accelerators([metal, CPU], [], mlx)
    assert (gpu.device, gpu.unified, gpu.memory_total, gpu.engines) == (
        "metal0",
        True,
        21 * GiB,
        ["llamacpp", "mlx"],
    )
    (mlx_only,) = accelerators([CPU], [], mlx)  # llama.cpp built without Metal
    assert (mlx_only.device, mlx_only.engines) == ("metal0", ["mlx"])


def test_an_integrated_gpu_shares_the_ram() -> None:
    (igpu,) = accelerators([CPU, ggml("Vulkan0", "Vulkan", 0, "igpu", 16 * GiB)], [], None)
    assert (igpu.device, igpu.unified) == ("vulkan0", True)


def test_pci_bus_ids_compare_in_one_form() -> None:
    assert pci_bus_id("00000000:C1:00.0") == pci_bus_id("0000:c1:00.0") == "0000:c1:00.0"
    assert pci_bus_id(None) is None and pci_bus_id("") is None
