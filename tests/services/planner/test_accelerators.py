"""Placement on accelerators: a GPU when one holds the model, a node's GPUs together in
proportion to their memory, the rest in RAM only when the GPUs cannot hold it all, a Mac's
unified memory counted once, and a mixed cluster. Synthetic profiles, folded as the projection
folds them."""

from __future__ import annotations

from events.catalogue import Event
from events.units import GiB
from services.planner.cluster import cluster_view
from services.planner.placement import place
from tests.services.planner.builders import (
    accelerator,
    ask,
    chat,
    fold_all,
    layout,
    model,
    node,
    parts,
    placed,
    placement,
    rejection,
    request,
    usable_of,
    view,
)

# --- one GPU --------------------------------------------------------------------------------


def test_a_model_one_gpu_holds_goes_on_the_gpu() -> None:
    cluster = view(node("a", 64 * GiB, accelerators=[accelerator("cuda", 0, 24 * GiB)]))
    result = placement(place(cluster, ask(model(size=8 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:cuda0", 0, 32)]
    assert result.shards[0].devices == []  # all on `device`
    assert result.charges == {"a:cuda0": 8 * GiB}
    assert result.why == ("one GPU holds it: a:cuda0 has 21.60 GiB usable for its 8.00 GiB",)


def test_a_gpu_too_small_takes_as_many_layers_as_fit_and_ram_the_rest() -> None:
    # 1 GiB a layer: 7.2 GiB usable on the card hold 7 of 32 layers.
    cluster = view(node("a", 64 * GiB, accelerators=[accelerator("cuda", 0, 8 * GiB)]))
    result = placement(place(cluster, ask(model(size=32 * GiB))))
    (shard,) = result.shards
    assert (shard.device, parts(shard)) == ("cuda0", [("cpu", 25), ("cuda0", 7)])
    assert result.charges == {"a:cpu": 25 * GiB, "a:cuda0": 7 * GiB}
    assert result.why[0] == (
        "no GPU or GPUs of a node holds it: as many of its layers as fit go on a's GPU"
        " (a:cuda0 7), the other 25 stay in RAM (32.00 GiB in all)"
    )


def test_the_engine_memory_is_counted_on_every_device_a_shard_uses() -> None:
    # 1 GiB a layer and 1 GiB of engine memory on each device: 7.2 - 1 GiB hold 6 layers.
    cluster = view(node("a", 64 * GiB, accelerators=[accelerator("cuda", 0, 8 * GiB)]))
    result = placement(place(cluster, ask(model(size=32 * GiB, overhead=GiB))))
    assert parts(result.shards[0]) == [("cpu", 26), ("cuda0", 6)]
    assert result.charges == {"a:cpu": 27 * GiB, "a:cuda0": 7 * GiB}


def test_the_gpu_beats_a_roomier_cpu_elsewhere() -> None:
    cluster = view(
        node("big", 256 * GiB), node("g", 16 * GiB, accelerators=[accelerator("cuda", 0, 8 * GiB)])
    )
    result = placement(place(cluster, ask(model(size=4 * GiB))))
    assert layout(result.shards) == [(0, 0, "g:cuda0", 0, 32)]


# --- two unequal GPUs ------------------------------------------------------------------------


TWO_GPUS = node(
    "a",
    64 * GiB,
    accelerators=[accelerator("cuda", 0, 24 * GiB), accelerator("cuda", 1, 16 * GiB)],
)


def test_two_gpus_of_a_node_hold_a_model_neither_holds_alone_in_proportion_to_memory() -> None:
    # 30 GiB, 30 layers; 21.6 and 14.4 GiB usable: layers 18 and 12, as 21.6:14.4.
    result = placement(place(view(TWO_GPUS), ask(model(size=30 * GiB, n_layers=30))))
    (shard,) = result.shards
    assert (shard.node_id, shard.device, shard.world_size) == ("a", "cuda0", 1)
    assert parts(shard) == [("cuda0", 18), ("cuda1", 12)]
    assert shard.tensor_split is None  # one runner: no pipeline
    assert result.charges == {"a:cuda0": 18 * GiB, "a:cuda1": 12 * GiB}
    assert result.why[0] == (
        "no GPU holds it: 2 GPUs of a hold its 30.00 GiB: layers in proportion to their"
        " usable memory (a:cuda0 21.60 GiB, a:cuda1 14.40 GiB)"
    )


def test_two_gpus_too_small_together_spill_the_rest_to_ram() -> None:
    # 1 GiB a layer: 21 + 14 layers on the cards, 5 in RAM.
    result = placement(place(view(TWO_GPUS), ask(model(size=40 * GiB, n_layers=40))))
    assert parts(result.shards[0]) == [("cpu", 5), ("cuda0", 21), ("cuda1", 14)]
    assert "the other 5 stay in RAM" in result.why[0]


def test_a_model_that_fits_one_of_two_gpus_uses_only_that_one() -> None:
    result = placement(place(view(TWO_GPUS), ask(model(size=20 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:cuda0", 0, 32)]
    assert result.shards[0].devices == []


def test_gpus_of_two_backends_are_not_mixed_in_one_runner() -> None:
    cluster = view(
        node(
            "a",
            2 * GiB,
            accelerators=[accelerator("cuda", 0, 16 * GiB), accelerator("vulkan", 0, 16 * GiB)],
        )
    )
    # 20 GiB: neither card alone, nor one with RAM, nor the two together (a runner uses one
    # backend).
    rejected = rejection(place(cluster, ask(model(size=20 * GiB))))
    assert "more than any device or set of nodes can hold" in rejected.reason


def test_a_runner_across_gpus_is_charged_per_device_once_placed() -> None:
    state = fold_all(TWO_GPUS, model(size=30 * GiB, n_layers=30), request())
    result = placement(place(cluster_view(state), ask(model(size=30 * GiB, n_layers=30))))
    after = fold_all(placed("i", result.shards, generation=1), state=state)
    assert usable_of(cluster_view(after)) == {
        "a:cpu": int(64 * GiB * 0.9),
        "a:cuda0": int(24 * GiB * 0.9) - 18 * GiB,
        "a:cuda1": int(16 * GiB * 0.9) - 12 * GiB,
    }


def test_placing_again_keeps_a_runner_across_gpus_as_it_is() -> None:
    added = model(size=30 * GiB, n_layers=30)
    first = placement(place(view(TWO_GPUS), ask(added)))
    again = placement(place(view(TWO_GPUS), ask(added, generation=2, current=first.shards)))
    assert again.kept_replicas == (0,)
    assert again.shards == first.shards
    assert again.why == ("kept where its runners run",)


# --- a Mac ------------------------------------------------------------------------------------


def mac(name: str = "mac", *, ram: int = 32 * GiB, working_set: int = 24 * GiB) -> list[Event]:
    """Apple silicon: the GPU's memory is the RAM, up to its recommended working set."""
    metal = accelerator("metal", 0, working_set, unified=True, engines=("llamacpp", "mlx"))
    return node(name, ram, accelerators=[metal])


def test_a_mac_runs_a_model_on_its_gpu() -> None:
    for engine in ("llamacpp", "mlx"):
        result = placement(place(view(mac()), ask(model(size=8 * GiB, engine=engine))))
        assert layout(result.shards) == [(0, 0, "mac:metal0", 0, 32)]


def test_a_macs_gpu_and_cpu_draw_on_one_memory() -> None:
    state = fold_all(mac(), model(size=16 * GiB), request())
    result = placement(place(cluster_view(state), ask(model(size=16 * GiB))))
    after = cluster_view(fold_all(placed("i", result.shards, generation=1), state=state))
    # 16 GiB on the GPU leave 21.6 - 16 of its working set, and 28.8 - 16 of the RAM.
    assert usable_of(after) == {
        "mac:cpu": int(32 * GiB * 0.9) - 16 * GiB,
        "mac:metal0": int(24 * GiB * 0.9) - 16 * GiB,
    }


def test_the_working_set_caps_a_macs_gpu_but_not_its_ram() -> None:
    # 25 GiB: more than the GPU's 21.6 usable; it does not spill into the same RAM.
    result = placement(place(view(mac()), ask(model(size=25 * GiB))))
    assert layout(result.shards) == [(0, 0, "mac:cpu", 0, 32)]
    assert result.why[0].startswith("in RAM: mac:cpu has 28.80 GiB usable for its 25.00 GiB")


def test_a_macs_gpu_offers_no_more_than_its_ram_has_left() -> None:
    state = fold_all(mac(), model("big", size=20 * GiB), model(size=8 * GiB))
    state = fold_all(request("big", "big", spec=chat(["mac:cpu"])), state=state)
    in_ram = ask(model("big", size=20 * GiB), spec=chat(["mac:cpu"]), instance_id="big")
    big = placement(place(cluster_view(state), in_ram))
    state = fold_all(placed("big", big.shards, model_id="big", generation=1), state=state)
    # The RAM has 8.8 GiB left: the GPU's working set (21.6) no longer counts.
    assert usable_of(cluster_view(state))["mac:metal0"] == int(32 * GiB * 0.9) - 20 * GiB
    rejected = rejection(place(cluster_view(state), ask(model(size=9 * GiB))))
    assert "mac:metal0 8.80 GiB" in rejected.reason


# --- a mixed cluster --------------------------------------------------------------------------


def test_replicas_in_a_mixed_cluster_take_the_gpus_first_then_a_fresh_node() -> None:
    cluster = view(
        node("cpu-box", 64 * GiB),
        node("pc", 16 * GiB, accelerators=[accelerator("cuda", 0, 8 * GiB)]),
        mac(),
    )
    result = placement(place(cluster, ask(model(size=6 * GiB), replicas=3)))
    assert layout(result.shards) == [
        (0, 0, "mac:metal0", 0, 32),  # the roomiest GPU
        (1, 0, "pc:cuda0", 0, 32),
        (2, 0, "cpu-box:cpu", 0, 32),  # a node no replica uses, before a second on a GPU
    ]
    assert result.why[2] == (
        "in RAM: cpu-box:cpu has 57.60 GiB usable for its 6.00 GiB; the GPUs that hold it"
        " alone serve other replicas"
    )


def test_a_gpu_no_engine_can_use_is_shown_but_not_placed_on() -> None:
    # NVML sees the card, but this node's llama.cpp was built without CUDA.
    seen = accelerator("cuda", 0, 24 * GiB, engines=())
    cluster = view(node("a", 64 * GiB, accelerators=[seen]))
    result = placement(place(cluster, ask(model(size=8 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32)]
    assert "no GPU online runs llamacpp (a:cuda0" in result.why[0]
    refused = rejection(place(cluster, ask(model(size=8 * GiB), spec=chat(["a:cuda0"]))))
    assert refused.reason == (
        "a:cuda0 does not run the llamacpp engine (no engine of its node can use it)"
    )


def test_an_mlx_model_stays_on_one_device() -> None:
    # MLX runs a process on one device: no split between GPUs, no spill into RAM.
    cluster = view(
        node(
            "a",
            64 * GiB,
            accelerators=[
                accelerator("cuda", 0, 8 * GiB, engines=("llamacpp", "mlx")),
                accelerator("cuda", 1, 8 * GiB, engines=("llamacpp", "mlx")),
            ],
        )
    )
    result = placement(place(cluster, ask(model(size=12 * GiB, engine="mlx"))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32)]
    refused = rejection(
        place(cluster, ask(model(size=12 * GiB, engine="mlx"), spec=chat(["a:cuda0", "a:cuda1"])))
    )
    assert refused.reason == "the mlx engine runs a shard on one device, not a:cuda0, a:cuda1"


def test_no_node_holds_it_then_nodes_share_it_with_the_head_in_ram() -> None:
    # 2 GiB a layer: no node holds 64 GiB; a's RAM and b's card do, in proportion to their
    # room (36 and 28.8 GiB).
    cluster = view(
        node("a", 40 * GiB),
        node("b", 4 * GiB, accelerators=[accelerator("cuda", 0, 32 * GiB)]),
    )
    result = placement(place(cluster, ask(model(size=64 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 18), (0, 1, "b:cuda0", 18, 32)]
    assert result.why[0].startswith("no node holds its 64.00 GiB")


# --- the placement spec -----------------------------------------------------------------------


def test_a_spec_with_two_gpus_of_a_node_makes_one_runner_split_by_tensor_split() -> None:
    spec = chat(["a:cuda0", "a:cuda1"], tensor_split=[3, 1])
    result = placement(place(view(TWO_GPUS), ask(model(size=8 * GiB), spec=spec)))
    (shard,) = result.shards
    assert (shard.device, parts(shard)) == ("cuda0", [("cuda0", 24), ("cuda1", 8)])
    assert (
        result.why[0] == "as the placement spec asks, layers in proportion to the spec's"
        " tensor_split"
    )


def test_a_spec_may_put_layers_in_ram_beside_a_gpu() -> None:
    spec = chat(["a:cuda1", "a:cpu"], tensor_split=[3, 1])
    result = placement(place(view(TWO_GPUS), ask(model(size=8 * GiB), spec=spec)))
    assert parts(result.shards[0]) == [("cpu", 8), ("cuda1", 24)]  # the CPU's layers first


def test_spec_shapes_a_runner_cannot_take_are_refused() -> None:
    cluster = view(TWO_GPUS, node("b", 64 * GiB, accelerators=[accelerator("cuda", 0, 8 * GiB)]))
    cases = {
        ("a:cuda0", "b:cpu", "a:cuda1"): "the devices of node 'a' must be listed together:"
        " they make one runner",
        ("a:cuda0", "b:cpu"): "the first stage of a llamacpp pipeline keeps its layers in RAM:"
        " give a:cpu as its device, not a:cuda0",
        ("a:cpu", "b:cpu", "b:cuda0"): "a later stage of a llamacpp pipeline serves one device:"
        " one of b:cpu, b:cuda0",
        ("a:cuda2",): "node 'a' has no device cuda2 (it has: cpu, cuda0, cuda1)",
    }
    for devices, reason in cases.items():
        refused = rejection(place(cluster, ask(model(size=GiB), spec=chat(list(devices)))))
        assert refused.reason == reason


# --- the preview --------------------------------------------------------------------------------


def test_the_preview_says_which_layers_land_on_which_device_and_why() -> None:
    from cli.instances import describe

    result = placement(place(view(TWO_GPUS), ask(model(size=40 * GiB, n_layers=40))))
    assert describe(result, "m").splitlines() == [
        "m: 1 replica, context 2048 tokens, 1 slot, 40.00 GiB per replica",
        "  replica 0 rank 0/1  a:cuda0  layers 0-39 (40)  40.00 GiB",
        "    a:cpu  layers 0-4 (5)",
        "    a:cuda0  layers 5-25 (21)",
        "    a:cuda1  layers 26-39 (14)",
        "    why: no GPU or GPUs of a node holds it: as many of its layers as fit go on a's GPUs"
        " (a:cuda0 21, a:cuda1 14), the other 5 stay in RAM (40.00 GiB in all)",
    ]
