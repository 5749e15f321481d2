"""What a runner gives llama.cpp (and MLX) for the shard placement gave it: the accelerators its
process sees and ``Llama``'s offload arguments, for one GPU, two unequal GPUs, GPUs with the
rest in RAM, a Mac, the CPU, and a pipeline's stages; placed by the planner's own ``place``
on synthetic profiles, so that the two agree."""

from __future__ import annotations

import llama_cpp
import pytest

from events.records import DeviceLayers, ShardAssignment
from events.units import GiB
from inference.engines.llamacpp.devices import GgmlDevice, list_devices
from inference.offload import (
    SPLIT_MODE_LAYER,
    SPLIT_MODE_NONE,
    accelerator_of,
    llama_offload,
    mlx_device,
    offload_problem,
    visible_devices,
)
from services.planner.placement import place
from services.runner.main import UnsupportedDevice, whole_model_offload
from tests.services.planner.builders import accelerator, ask, model, node, placement, view

NO_ENV: dict[str, str] = {}
HIDDEN = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}


def shard(
    device: str = "cpu",
    parts: list[tuple[str, int]] | None = None,
    n: int = 32,
    rank: int = 0,
    world: int = 1,
) -> ShardAssignment:
    return ShardAssignment(
        runner_id="r",
        node_id="a",
        device=device,
        rank=rank,
        world_size=world,
        devices=[DeviceLayers(device=d, layers=k) for d, k in parts or []],
        start_layer=0,
        end_layer=n,
        n_layers=n,
    )


def test_the_split_modes_are_llama_hs() -> None:
    assert (SPLIT_MODE_NONE, SPLIT_MODE_LAYER) == (
        llama_cpp.LLAMA_SPLIT_MODE_NONE,
        llama_cpp.LLAMA_SPLIT_MODE_LAYER,
    )


def test_a_cpu_shard_sees_no_gpu_and_offloads_nothing() -> None:
    s = shard("cpu")
    assert visible_devices(s, NO_ENV) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **HIDDEN}
    assert llama_offload(s) == {"n_gpu_layers": 0, "split_mode": SPLIT_MODE_NONE, "main_gpu": -1}
    assert mlx_device(s) == "cpu"


def test_one_gpu_takes_every_layer_and_the_output() -> None:
    cluster = view(node("a", 64 * GiB, accelerators=[accelerator("cuda", 0, 24 * GiB)]))
    (s,) = placement(place(cluster, ask(model(size=8 * GiB)))).shards
    assert visible_devices(s, NO_ENV) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        **HIDDEN,
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert llama_offload(s) == {"n_gpu_layers": 33, "split_mode": SPLIT_MODE_NONE, "main_gpu": 0}
    assert mlx_device(s) == "gpu"


def test_two_unequal_gpus_get_their_layer_counts_as_tensor_split() -> None:
    cluster = view(
        node(
            "a",
            64 * GiB,
            accelerators=[
                accelerator("cuda", 0, 16 * GiB),
                accelerator("cuda", 1, 24 * GiB),
            ],
        )
    )
    (s,) = placement(place(cluster, ask(model(size=30 * GiB, n_layers=30)))).shards
    assert [(d.device, d.layers) for d in s.devices] == [("cuda1", 18), ("cuda0", 12)]
    # The roomier card first: its process sees it as CUDA0.
    assert visible_devices(s, NO_ENV)["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert llama_offload(s) == {
        "n_gpu_layers": 31,
        "split_mode": SPLIT_MODE_LAYER,
        "main_gpu": 0,
        "tensor_split": [18.0, 13.0],  # the output layer with the last card's
    }


def test_layers_the_gpus_cannot_hold_stay_in_ram_with_the_output_layer() -> None:
    cluster = view(
        node(
            "a",
            64 * GiB,
            accelerators=[
                accelerator("cuda", 0, 24 * GiB),
                accelerator("cuda", 1, 16 * GiB),
            ],
        )
    )
    (s,) = placement(place(cluster, ask(model(size=40 * GiB, n_layers=40)))).shards
    assert s.device_layers() == [("cpu", 5), ("cuda0", 21), ("cuda1", 14)]
    assert llama_offload(s) == {
        "n_gpu_layers": 35,
        "split_mode": SPLIT_MODE_LAYER,
        "main_gpu": 0,
        "tensor_split": [21.0, 14.0],
    }


def test_a_macs_gpu_needs_no_variable_and_other_backends_stay_hidden() -> None:
    metal = accelerator("metal", 0, 24 * GiB, unified=True, engines=("llamacpp", "mlx"))
    (s,) = placement(
        place(view(node("mac", 32 * GiB, accelerators=[metal])), ask(model(size=8 * GiB)))
    ).shards
    assert s.device == "metal0"
    assert visible_devices(s, NO_ENV) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **HIDDEN}
    assert llama_offload(s) == {"n_gpu_layers": 33, "split_mode": SPLIT_MODE_NONE, "main_gpu": 0}
    assert mlx_device(s) == "gpu"


def test_a_pipelines_stages_see_their_own_device() -> None:
    cluster = view(
        node("a", 40 * GiB),
        node(
            "b",
            4 * GiB,
            accelerators=[
                accelerator("vulkan", 1, 32 * GiB),
            ],
        ),
    )
    head, stage = placement(place(cluster, ask(model(size=64 * GiB)))).shards
    assert (head.device, stage.device) == ("cpu", "vulkan1")
    assert visible_devices(head, NO_ENV) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **HIDDEN}
    assert visible_devices(stage, NO_ENV)["GGML_VK_VISIBLE_DEVICES"] == "1"


def test_the_workers_own_visible_devices_are_what_indices_count_in() -> None:
    s = shard("cuda1", [("cuda1", 16), ("cuda0", 16)])
    env = visible_devices(s, {"CUDA_VISIBLE_DEVICES": "2, 3", "HIP_VISIBLE_DEVICES": "0"})
    assert (env["CUDA_VISIBLE_DEVICES"], env["HIP_VISIBLE_DEVICES"]) == ("3,2", "")


def test_a_gpu_as_older_workers_named_it_is_a_cuda_device() -> None:
    assert accelerator_of("gpu2") == ("cuda", 2)
    assert accelerator_of("vulkan10") == ("vulkan", 10)
    assert accelerator_of("cpu") is None
    with pytest.raises(ValueError, match="unknown device 'tpu0'"):
        accelerator_of("tpu0")
    assert visible_devices(shard("gpu1"), NO_ENV)["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_shard_llamacpp_here_cannot_offload_fails_with_the_reason() -> None:
    # This machine's llama.cpp is built for the CPU: its registry lists no GPU.
    assert offload_problem(shard("cpu"), list_devices()) is None
    problem = offload_problem(shard("cuda0"), list_devices())
    assert problem is not None and problem.startswith(
        "placed on cuda0, but llama.cpp here offers none: was it built for cuda?"
    )
    with pytest.raises(UnsupportedDevice, match="placed on cuda0"):
        whole_model_offload(shard("cuda0"))
    assert whole_model_offload(shard("cpu"))["main_gpu"] == -1


def test_the_devices_llamacpp_offers_must_be_the_shards() -> None:
    def gpu(name: str, registry: str, index: int) -> GgmlDevice:
        return GgmlDevice(name=name, registry=registry, index=index, type="gpu")

    two = shard("cuda0", [("cuda0", 16), ("cuda1", 16)])
    assert offload_problem(two, [gpu("CUDA0", "CUDA", 0), gpu("CUDA1", "CUDA", 1)]) is None
    assert offload_problem(two, [gpu("CUDA0", "CUDA", 0)]) is not None  # one hidden too many
    assert offload_problem(shard("cuda0"), [gpu("Vulkan0", "Vulkan", 0)]) is not None


def test_mlx_runs_a_shard_in_ram_on_its_cpu_and_says_when_it_has_no_gpu() -> None:
    import mlx.core as mx

    from services.runner.main import use_mlx_device

    use_mlx_device(shard("cpu"))
    assert mx.default_device() == mx.cpu
    if not (mx.metal.is_available() or mx.cuda.is_available()):  # mlx[cpu], as here
        with pytest.raises(UnsupportedDevice, match="placed on metal0, but MLX has no GPU here"):
            use_mlx_device(shard("metal0"))
