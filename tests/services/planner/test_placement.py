"""Placement: where an instance's shards run, automatically or by a manual spec."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalogue import Event, NodeLeft, NodeTimedOut
from events.records import AcceleratorBackend
from events.units import GiB, MiB
from services.planner.cluster import ClusterView, device_layers
from services.planner.placement import Placement, place
from services.planner.placement_spec import MAX_REPLICAS
from services.planner.placement_why import gib
from tests.services.planner.builders import (
    accelerator,
    ask,
    at,
    chat,
    gpu,
    info,
    layout,
    model,
    node,
    parts,
    placed,
    placement,
    rejection,
    request,
    shard,
    usable,
    view,
)

# --- one device ---------------------------------------------------------------------------


def test_a_model_that_fits_one_node_goes_to_the_roomiest() -> None:
    cluster = view(node("a", 10 * GiB), node("b", 20 * GiB), node("c", 15 * GiB))
    result = placement(place(cluster, ask(model(size=8 * GiB, n_layers=32))))
    assert layout(result.shards) == [(0, 0, "b:cpu", 0, 32)]
    (s,) = result.shards
    assert (s.runner_id, s.world_size, s.n_layers, s.tensor_split) == ("i-g1-r0-s0", 1, 32, None)
    assert result.charges == {"b:cpu": 8 * GiB}
    assert result.need_bytes == 8 * GiB
    assert result.context_length == 2048
    assert result.kept_replicas == ()


def test_runner_ids_name_the_instance_and_generation() -> None:
    cluster = view(node("a", 10 * GiB))
    result = placement(place(cluster, ask(model(size=GiB), instance_id="chat-1", generation=7)))
    assert [s.runner_id for s in result.shards] == ["chat-1-g7-r0-s0"]


@pytest.mark.parametrize(
    ("size", "kv", "overhead", "fits"),
    [
        (9 * GiB, 0, 0, True),  # need == usable: fits
        (9 * GiB + 1, 0, 0, False),  # one byte more: does not
        # 8 GiB weights + 256 KiB x 2048 tokens (512 MiB) + 512 MiB engine = 9 GiB exactly.
        (8 * GiB, 256 * 1024, 512 * MiB, True),
        (8 * GiB, 256 * 1024, 512 * MiB + 1, False),
    ],
)
def test_the_need_may_reach_ninety_percent_of_the_offer_and_no_further(
    size: int, kv: int, overhead: int, fits: bool
) -> None:
    cluster = view(node("a", 10 * GiB))
    result = place(cluster, ask(model(size=size, n_layers=1, kv=kv, overhead=overhead)))
    need = size + kv * 2048 + overhead
    if fits:
        assert layout(placement(result).shards) == [(0, 0, "a:cpu", 0, 1)]
        assert placement(result).charges == {"a:cpu": 9 * GiB}
    else:
        assert rejection(result).needed_bytes == need == 9 * GiB + 1
        assert rejection(result).available_bytes == {"a:cpu": 9 * GiB}


def test_a_gpu_that_fits_is_preferred_to_a_roomier_cpu() -> None:
    cluster = view(node("a", 64 * GiB, gpus=[gpu(0, 24 * GiB)]))
    result = placement(place(cluster, ask(model(size=16 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:gpu0", 0, 32)]
    assert result.charges == {"a:gpu0": 16 * GiB}


def test_a_gpu_on_another_node_is_preferred_to_a_roomier_cpu() -> None:
    cluster = view(node("a", 64 * GiB), node("b", 10 * GiB, gpus=[gpu(0, 24 * GiB)]))
    result = placement(place(cluster, ask(model(size=16 * GiB))))
    assert layout(result.shards) == [(0, 0, "b:gpu0", 0, 32)]


def test_of_the_gpus_that_fit_the_roomiest_wins() -> None:
    cluster = view(node("a", 64 * GiB, gpus=[gpu(0, 16 * GiB), gpu(1, 24 * GiB)]))
    result = placement(place(cluster, ask(model(size=8 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:gpu1", 0, 32)]


def test_a_gpu_too_small_holds_what_it_can_and_the_cpu_the_rest() -> None:
    # Half a GiB a layer: 7.2 GiB usable on the GPU hold 14 layers, RAM the other 18.
    cluster = view(node("a", 64 * GiB, gpus=[gpu(0, 8 * GiB)]))
    result = placement(place(cluster, ask(model(size=16 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:gpu0", 0, 32)]
    assert parts(result.shards[0]) == [("cpu", 18), ("gpu0", 14)]
    assert result.charges == {"a:cpu": 9 * GiB, "a:gpu0": 7 * GiB}
    assert result.shard_bytes == {"i-g1-r0-s0": 16 * GiB}


def test_the_context_sets_the_kv_cache_part_of_the_need() -> None:
    # 1 MiB of KV cache per token: 2048 tokens by default, 8192 when asked.
    cluster = view(node("a", 10 * GiB), node("b", 20 * GiB))
    added = model(size=4 * GiB, kv=MiB, context_length=32768)
    default = placement(place(cluster, ask(added)))
    assert (default.context_length, default.need_bytes) == (2048, 6 * GiB)
    longer = placement(place(cluster, ask(added, context_length=8192)))
    assert (longer.context_length, longer.need_bytes) == (8192, 12 * GiB)
    assert layout(longer.shards) == [(0, 0, "b:cpu", 0, 32)]


def test_the_default_context_is_capped_at_what_the_model_was_trained_for() -> None:
    cluster = view(node("a", 10 * GiB))
    result = placement(place(cluster, ask(model(size=GiB, kv=MiB, context_length=1024))))
    assert (result.context_length, result.need_bytes) == (1024, 2 * GiB)


def test_a_context_beyond_the_trained_one_is_rejected() -> None:
    cluster = view(node("a", 10 * GiB))
    result = rejection(
        place(cluster, ask(model(size=GiB, context_length=4096), context_length=8192))
    )
    assert result.reason == "a context of 8192 tokens is more than m was trained for (4096)"


def test_avoided_devices_are_not_used() -> None:
    cluster = view(node("a", 20 * GiB), node("b", 10 * GiB))
    result = placement(place(cluster, ask(model(size=8 * GiB), avoid={"a:cpu"})))
    assert layout(result.shards) == [(0, 0, "b:cpu", 0, 32)]


# --- split over nodes ---------------------------------------------------------------------


def test_a_model_too_big_for_any_node_is_split_over_the_fewest_nodes() -> None:
    # Five nodes; two (18 + 9 GiB usable) hold 24 GiB. Layers go 18:9, so 16 and 8.
    cluster = view(
        node("a", 20 * GiB),
        node("b", 10 * GiB),
        node("c", 10 * GiB),
        node("d", 10 * GiB),
        node("e", 10 * GiB),
    )
    result = placement(place(cluster, ask(model(size=24 * GiB, n_layers=24))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 16), (0, 1, "b:cpu", 16, 24)]
    assert [(s.world_size, s.tensor_split) for s in result.shards] == [(2, [16.0, 8.0])] * 2
    assert [s.runner_id for s in result.shards] == ["i-g1-r0-s0", "i-g1-r0-s1"]
    assert all(s.n_layers == 24 for s in result.shards)
    assert result.charges == {"a:cpu": 16 * GiB, "b:cpu": 8 * GiB}
    assert result.shard_bytes == {"i-g1-r0-s0": 16 * GiB, "i-g1-r0-s1": 8 * GiB}
    assert result.need_bytes == 24 * GiB


def test_the_roomiest_node_is_the_head_whatever_its_name() -> None:
    cluster = view(node("alpha", 10 * GiB), node("zulu", 20 * GiB))
    result = placement(place(cluster, ask(model(size=24 * GiB, n_layers=24))))
    assert layout(result.shards) == [(0, 0, "zulu:cpu", 0, 16), (0, 1, "alpha:cpu", 16, 24)]


def test_a_split_uses_three_nodes_when_two_are_not_enough() -> None:
    cluster = view(*(node(n, 10 * GiB) for n in "abcd"))
    result = placement(place(cluster, ask(model(size=24 * GiB, n_layers=24))))
    assert layout(result.shards) == [
        (0, 0, "a:cpu", 0, 8),
        (0, 1, "b:cpu", 8, 16),
        (0, 2, "c:cpu", 16, 24),
    ]
    assert {s.world_size for s in result.shards} == {3}
    assert {tuple(s.tensor_split or ()) for s in result.shards} == {(8.0, 8.0, 8.0)}


def test_layers_are_split_by_the_room_left_after_each_runners_engine_overhead() -> None:
    # 16 GiB of weights + 4 GiB engine per runner. Room for layers: 18-4 = 14 and 9-4 = 5 GiB,
    # so 24 layers go 18:6. (By raw room, 16:8, b would need 5.33 + 4 > 9 GiB.)
    cluster = view(node("a", 20 * GiB), node("b", 10 * GiB))
    result = placement(place(cluster, ask(model(size=16 * GiB, n_layers=24, overhead=4 * GiB))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 18), (0, 1, "b:cpu", 18, 24)]
    assert result.charges == {"a:cpu": 12 * GiB + 4 * GiB, "b:cpu": 4 * GiB + 4 * GiB}
    assert result.shard_bytes == {"i-g1-r0-s0": 16 * GiB, "i-g1-r0-s1": 8 * GiB}
    assert result.need_bytes == 20 * GiB


def test_a_split_takes_the_roomiest_device_of_each_node() -> None:
    # 2 GiB a layer. Neither node holds 48 GiB, GPU and RAM together (a: 3 + 18 layers).
    cluster = view(
        node("a", 40 * GiB, gpus=[gpu(0, 8 * GiB)]),
        node("b", 4 * GiB, gpus=[gpu(0, 20 * GiB)]),
    )
    result = placement(place(cluster, ask(model(size=48 * GiB, n_layers=24))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 16), (0, 1, "b:gpu0", 16, 24)]


def test_a_llamacpp_pipeline_head_keeps_its_layers_in_ram() -> None:
    # a's GPU is the roomiest device, but a llama.cpp head's layers stay in RAM: the head is
    # the chosen node with the most RAM (b), and a serves its GPU to it.
    cluster = view(node("a", 10 * GiB, gpus=[gpu(0, 40 * GiB)]), node("b", 30 * GiB))
    result = placement(place(cluster, ask(model(size=60 * GiB, n_layers=24))))
    assert layout(result.shards) == [(0, 0, "b:cpu", 0, 10), (0, 1, "a:gpu0", 10, 24)]
    assert "the head keeps its layers in RAM" in result.why[0]


def usable_of_all(cluster: ClusterView) -> list[int]:
    return sorted((d.usable for d in cluster.devices.values()), reverse=True)


def test_a_model_that_fits_three_nodes_split_by_room_is_placed() -> None:
    # 72 GiB over 4 layers (18 GiB each); two nodes hold 63 GiB, three hold 81.
    cluster = view(node("a", 40 * GiB), node("b", 30 * GiB), node("c", 20 * GiB))
    assert usable_of_all(cluster) == [36 * GiB, 27 * GiB, 18 * GiB]
    result = placement(place(cluster, ask(model(size=72 * GiB, n_layers=4))))
    assert layout(result.shards) == [
        (0, 0, "a:cpu", 0, 2),
        (0, 1, "b:cpu", 2, 3),
        (0, 2, "c:cpu", 3, 4),
    ]


# --- rejections ---------------------------------------------------------------------------


def test_a_model_that_fits_nowhere_is_rejected_with_what_it_needs_and_what_there_is() -> None:
    cluster = view(node("a", 10 * GiB), node("b", 10 * GiB), node("c", GiB))
    added = model("llama", size=28 * GiB, kv=512 * 1024, overhead=GiB)
    result = rejection(place(cluster, ask(added)))
    assert result.reason == (
        "llama needs 30.00 GiB for a context of 2048 tokens (weights 28.00 GiB, KV cache"
        " 1.00 GiB, engine 1.00 GiB per runner), more than any device or set of nodes can"
        " hold. Usable now (90% of what is offered, less what is placed): a:cpu 9.00 GiB,"
        " b:cpu 9.00 GiB, c:cpu 922 MiB"
    )
    assert result.needed_bytes == 30 * GiB
    assert result.available_bytes == {
        "a:cpu": 9 * GiB,
        "b:cpu": 9 * GiB,
        "c:cpu": usable(GiB),
    }


def test_a_rejection_shows_the_eight_roomiest_devices_and_counts_the_rest() -> None:
    cluster = view(*(node(f"n{i}", (i + 1) * GiB) for i in range(10)))
    result = rejection(place(cluster, ask(model(size=100 * GiB, n_layers=4))))
    assert "n9:cpu 9.00 GiB, n8:cpu 8.10 GiB" in result.reason
    assert result.reason.endswith("n2:cpu 2.70 GiB and 2 more")
    assert "n1:cpu" not in result.reason
    assert len(result.available_bytes) == 10


def test_a_rejection_shows_an_overcommitted_device_as_zero() -> None:
    cluster = view(node("a", 10 * GiB)).reserve({"a:cpu": 10 * GiB})
    result = rejection(place(cluster, ask(model(size=GiB))))
    assert result.available_bytes == {"a:cpu": 0}
    assert "a:cpu 0 MiB" in result.reason


def test_with_no_node_online_the_rejection_says_so() -> None:
    for cluster in (
        view(),
        view(node("a", 10 * GiB), NodeLeft(node_id="a", origin="a", ts=at(5))),
    ):
        result = rejection(place(cluster, ask(model(size=4 * GiB))))
        assert result.reason == "m needs 4.00 GiB and no node is online to place it on"
        assert (result.needed_bytes, result.available_bytes) == (4 * GiB, {})


def test_an_unknown_model_is_rejected() -> None:
    result = rejection(place(view(node("a", 10 * GiB)), ask(None)))
    assert result.reason == "the model is not known to the cluster: add it with `shoal models add`"
    assert result.needed_bytes is None


@pytest.mark.parametrize("replicas", [0, -1, MAX_REPLICAS + 1])
def test_replicas_out_of_range_are_rejected(replicas: int) -> None:
    result = rejection(place(view(node("a", 10 * GiB)), ask(model(size=MiB), replicas=replicas)))
    assert result.reason == f"replicas must be between 1 and 64, not {replicas}"


def test_sixty_four_replicas_are_allowed() -> None:
    result = placement(place(view(node("a", 10 * GiB)), ask(model(size=MiB), replicas=64)))
    assert len(result.shards) == 64
    assert result.charges == {"a:cpu": 64 * MiB}


def test_gib_writes_mib_below_one_gib() -> None:
    assert gib(GiB) == "1.00 GiB"
    assert gib(GiB - 1) == "1024 MiB"
    assert gib(512 * MiB) == "512 MiB"
    assert gib(0) == "0 MiB"
    assert gib(int(2.5 * GiB)) == "2.50 GiB"


# --- replicas -----------------------------------------------------------------------------


def test_replicas_go_to_distinct_nodes_when_there_are_enough() -> None:
    cluster = view(node("a", 20 * GiB), node("b", 15 * GiB), node("c", 10 * GiB))
    result = placement(place(cluster, ask(model(size=8 * GiB), replicas=2)))
    # Replica 1 takes b (13.5 GiB) rather than what is left on a (10 GiB).
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "b:cpu", 0, 32)]
    assert [s.runner_id for s in result.shards] == ["i-g1-r0-s0", "i-g1-r1-s0"]
    assert result.charges == {"a:cpu": 8 * GiB, "b:cpu": 8 * GiB}
    assert result.need_bytes == 8 * GiB


def test_replicas_share_a_device_when_only_one_node_has_room_for_both() -> None:
    cluster = view(node("a", 30 * GiB), node("b", 10 * GiB))
    result = placement(place(cluster, ask(model(size=10 * GiB), replicas=2)))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "a:cpu", 0, 32)]
    assert result.charges == {"a:cpu": 20 * GiB}


def test_replicas_on_one_node_take_another_device_before_sharing_one() -> None:
    cluster = view(node("a", 30 * GiB, gpus=[gpu(0, 24 * GiB)]))
    result = placement(place(cluster, ask(model(size=10 * GiB), replicas=2)))
    assert layout(result.shards) == [(0, 0, "a:gpu0", 0, 32), (1, 0, "a:cpu", 0, 32)]


def test_each_replica_of_a_split_model_takes_nodes_the_others_do_not_use() -> None:
    cluster = view(*(node(n, 10 * GiB) for n in "abcd"))
    result = placement(place(cluster, ask(model(size=12 * GiB, n_layers=12), replicas=2)))
    assert layout(result.shards) == [
        (0, 0, "a:cpu", 0, 6),
        (0, 1, "b:cpu", 6, 12),
        (1, 0, "c:cpu", 0, 6),
        (1, 1, "d:cpu", 6, 12),
    ]
    assert [s.runner_id for s in result.shards] == [
        "i-g1-r0-s0",
        "i-g1-r0-s1",
        "i-g1-r1-s0",
        "i-g1-r1-s1",
    ]


def test_a_replica_that_cannot_fit_rejects_the_instance_naming_the_replica() -> None:
    cluster = view(node("a", 20 * GiB))
    result = rejection(place(cluster, ask(model(size=10 * GiB), replicas=2)))
    assert result.reason.startswith("replica 2 of 2: m needs 10.00 GiB for a context of 2048")
    assert result.reason.endswith("a:cpu 8.00 GiB")
    assert result.needed_bytes == 10 * GiB
    assert result.available_bytes == {"a:cpu": 8 * GiB}


def test_memory_held_by_other_instances_counts() -> None:
    # x holds 10 GiB of b's 27, leaving 17 GiB: a (18 GiB) is now the roomiest.
    history: list[Event | list[Event]] = [
        node("a", 20 * GiB),
        node("b", 30 * GiB),
        model("other", size=10 * GiB, n_layers=8),
        request("x", "other"),
        placed("x", [shard("x-g1-r0-s0", "b", (0, 8), 8)], model_id="other"),
    ]
    added = model(size=8 * GiB)
    result = placement(place(view(*history), ask(added)))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32)]
    # Without x (as when x itself is placed again) b is the roomiest.
    result = placement(place(view(*history, excluding="x"), ask(added)))
    assert layout(result.shards) == [(0, 0, "b:cpu", 0, 32)]


# --- manual placement ---------------------------------------------------------------------


def test_a_manual_spec_puts_the_model_on_the_device_it_names() -> None:
    cluster = view(node("a", 20 * GiB), node("b", 10 * GiB))
    result = placement(place(cluster, ask(model(size=4 * GiB), spec=chat(["b:cpu"]))))
    assert layout(result.shards) == [(0, 0, "b:cpu", 0, 32)]
    assert result.shards[0].tensor_split is None
    assert result.charges == {"b:cpu": 4 * GiB}


def test_a_manual_tensor_split_of_3_to_1_gives_18_and_6_of_24_layers() -> None:
    cluster = view(node("a", 20 * GiB), node("b", 10 * GiB, gpus=[gpu(0, 24 * GiB)]))
    spec = chat(["a:cpu", "b:gpu0"], tensor_split=[3, 1])
    result = placement(place(cluster, ask(model(size=12 * GiB, n_layers=24), spec=spec)))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 18), (0, 1, "b:gpu0", 18, 24)]
    assert [(s.world_size, s.tensor_split) for s in result.shards] == [(2, [18.0, 6.0])] * 2
    assert result.charges == {"a:cpu": 9 * GiB, "b:gpu0": 3 * GiB}


def test_a_manual_split_without_tensor_split_goes_by_room_in_the_order_given() -> None:
    cluster = view(node("a", 20 * GiB), node("b", 10 * GiB))
    result = placement(
        place(cluster, ask(model(size=6 * GiB, n_layers=24), spec=chat(["b:cpu", "a:cpu"])))
    )
    assert layout(result.shards) == [(0, 0, "b:cpu", 0, 8), (0, 1, "a:cpu", 8, 24)]


def test_manual_replicas_take_one_block_of_devices_each() -> None:
    cluster = view(*(node(n, 10 * GiB) for n in "abcd"))
    spec = chat(["a:cpu", "b:cpu", "c:cpu", "d:cpu"], replicas=2, tensor_split=[3, 1, 1, 1])
    result = placement(place(cluster, ask(model(size=4 * GiB, n_layers=24), spec=spec)))
    assert layout(result.shards) == [
        (0, 0, "a:cpu", 0, 18),
        (0, 1, "b:cpu", 18, 24),
        (1, 0, "c:cpu", 0, 12),
        (1, 1, "d:cpu", 12, 24),
    ]
    assert [s.tensor_split for s in result.shards] == [[18.0, 6.0]] * 2 + [[12.0, 12.0]] * 2


def test_manual_replicas_over_two_devices_take_one_each() -> None:
    cluster = view(node("a", 10 * GiB), node("b", 10 * GiB))
    spec = chat(["a:cpu", "b:cpu"], replicas=2)
    result = placement(place(cluster, ask(model(size=4 * GiB), spec=spec)))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "b:cpu", 0, 32)]
    assert [s.runner_id for s in result.shards] == ["i-g1-r0-s0", "i-g1-r1-s0"]


def test_manual_replicas_on_one_device_share_it_until_it_is_full() -> None:
    cluster = view(node("a", 20 * GiB))
    fits = placement(place(cluster, ask(model(size=8 * GiB), spec=chat(["a:cpu"], replicas=2))))
    assert layout(fits.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "a:cpu", 0, 32)]
    assert fits.charges == {"a:cpu": 16 * GiB}
    full = rejection(place(cluster, ask(model(size=10 * GiB), spec=chat(["a:cpu"], replicas=2))))
    assert full.reason == (
        "replica 2 of 2: a:cpu: its share (the whole model) needs 10.00 GiB but 8.00 GiB"
        " is usable there"
    )
    assert (full.needed_bytes, full.available_bytes) == (10 * GiB, {"a:cpu": 8 * GiB})


def test_a_manual_spec_with_more_than_64_replicas_is_rejected() -> None:
    cluster = view(node("a", 10 * GiB))
    result = place(cluster, ask(model(size=MiB), spec=chat(["a:cpu"], replicas=65)))
    assert rejection(result).reason == (
        "invalid placement: role 'chat': 'replicas' is 65: at most 64 replicas of one instance"
    )


def _cluster_for_manual_errors() -> ClusterView:
    return view(
        node("a", 10 * GiB, gpus=[gpu(0, 8 * GiB)]),
        node("b", 20 * GiB),
        node("c", 10 * GiB),
        NodeTimedOut(node_id="c", origin="planner", ts=at(9), last_seen=at(0), missed_heartbeats=3),
    )


@pytest.mark.parametrize(
    ("devices", "reason"),
    [
        (["zz:cpu"], "unknown node 'zz' (nodes: a, b, c)"),
        (["c:cpu"], "node 'c' is timed out"),
        (["a:gpu1"], "node 'a' has no device gpu1 (it has: cpu, gpu0)"),
        (["b:cpu", "a:gpu3"], "node 'a' has no device gpu3 (it has: cpu, gpu0)"),
    ],
)
def test_a_manual_spec_naming_what_is_not_there_is_rejected(
    devices: list[str], reason: str
) -> None:
    result = rejection(
        place(_cluster_for_manual_errors(), ask(model(size=GiB, n_layers=8), spec=chat(devices)))
    )
    assert result.reason == reason


def test_a_manual_device_too_small_for_the_whole_model_is_rejected_with_sizes() -> None:
    cluster = view(node("a", 10 * GiB))
    result = rejection(place(cluster, ask(model(size=12 * GiB), spec=chat(["a:cpu"]))))
    assert result.reason == (
        "a:cpu: its share (the whole model) needs 12.00 GiB but 9.00 GiB is usable there"
    )
    assert (result.needed_bytes, result.available_bytes) == (12 * GiB, {"a:cpu": 9 * GiB})


def test_a_manual_device_too_small_for_its_share_is_rejected_in_mib() -> None:
    cluster = view(node("a", 20 * GiB), node("b", GiB))
    spec = chat(["a:cpu", "b:cpu"], tensor_split=[1, 1])
    result = rejection(place(cluster, ask(model(size=20 * GiB, n_layers=24), spec=spec)))
    assert result.reason == (
        "b:cpu: its share (12 of 24 layers) needs 10.00 GiB but 922 MiB is usable there"
    )
    assert (result.needed_bytes, result.available_bytes) == (10 * GiB, {"b:cpu": usable(GiB)})


def test_more_manual_devices_than_layers_is_rejected() -> None:
    cluster = view(node("a", 10 * GiB), node("b", 10 * GiB))
    result = rejection(
        place(cluster, ask(model(size=GiB, n_layers=1), spec=chat(["a:cpu", "b:cpu"])))
    )
    assert result.reason == "2 devices for a model of 1 layers"


def test_a_manual_device_where_runners_kept_failing_is_rejected() -> None:
    cluster = view(node("a", 10 * GiB))
    result = rejection(place(cluster, ask(model(size=GiB), spec=chat(["a:cpu"]), avoid={"a:cpu"})))
    assert result.reason == "runners of this instance kept failing on a:cpu"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("{", "the placement is not valid JSON"),
        ('{"chat": {}}', "role 'chat': 'devices' is missing"),
        ('{"chat": {"devices": ["a"]}}', "'a' is not a device"),
        ('{"summarise": {"devices": ["a:cpu"]}}', "unknown role 'summarise'"),
    ],
)
def test_a_malformed_spec_is_an_invalid_placement(spec: str, fragment: str) -> None:
    result = rejection(place(view(node("a", 10 * GiB)), ask(model(size=GiB), spec=spec)))
    assert result.reason.startswith("invalid placement: ")
    assert fragment in result.reason


# --- placing again ------------------------------------------------------------------------


def _two_replicas() -> tuple[list[Event | list[Event]], Placement]:
    """Nodes a, b, c (18, 13.5, 9 GiB usable) and an 8 GiB model's two replicas on a and b."""
    nodes: list[Event | list[Event]] = [
        node("a", 20 * GiB),
        node("b", 15 * GiB),
        node("c", 10 * GiB),
    ]
    first = placement(place(view(*nodes), ask(model(size=8 * GiB), replicas=2)))
    assert layout(first.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "b:cpu", 0, 32)]
    return nodes, first


def test_placing_again_keeps_the_replicas_that_are_fine_with_their_runners() -> None:
    nodes, first = _two_replicas()
    cluster = view(*nodes, NodeLeft(node_id="b", origin="b", ts=at(5)))
    again = placement(
        place(cluster, ask(model(size=8 * GiB), replicas=2, generation=2, current=first.shards))
    )
    assert again.kept_replicas == (0,)
    assert layout(again.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "c:cpu", 0, 32)]
    assert again.shards[0] == first.shards[0]
    assert [s.runner_id for s in again.shards] == ["i-g1-r0-s0", "i-g2-r1-s0"]
    assert again.charges == {"a:cpu": 8 * GiB, "c:cpu": 8 * GiB}


def test_placing_again_moves_a_replica_off_an_avoided_device() -> None:
    nodes, first = _two_replicas()
    req = ask(model(size=8 * GiB), replicas=2, generation=2, current=first.shards, avoid={"b:cpu"})
    again = placement(place(view(*nodes), req))
    assert again.kept_replicas == (0,)
    assert layout(again.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "c:cpu", 0, 32)]
    assert [s.runner_id for s in again.shards] == ["i-g1-r0-s0", "i-g2-r1-s0"]


def test_placing_again_with_nothing_wrong_keeps_everything() -> None:
    nodes, first = _two_replicas()
    again = placement(
        place(
            view(*nodes), ask(model(size=8 * GiB), replicas=2, generation=2, current=first.shards)
        )
    )
    assert again.kept_replicas == (0, 1)
    assert again.shards == first.shards


def test_placing_again_counts_the_memory_of_the_kept_replicas() -> None:
    # Only a is left: its kept replica holds 8 of 18 GiB, so the moved one still fits there...
    nodes, first = _two_replicas()
    gone: list[Event] = [
        NodeLeft(node_id="b", origin="b", ts=at(5)),
        NodeLeft(node_id="c", origin="c", ts=at(5)),
    ]
    req = ask(model(size=8 * GiB), replicas=2, generation=2, current=first.shards)
    again = placement(place(view(*nodes, gone), req))
    assert layout(again.shards) == [(0, 0, "a:cpu", 0, 32), (1, 0, "a:cpu", 0, 32)]
    assert again.charges == {"a:cpu": 16 * GiB}
    # ...but a replica of 10 GiB does not fit in the 8 GiB the kept one leaves.
    req = ask(model(size=10 * GiB), replicas=2, generation=2, current=first.shards)
    result = rejection(place(view(*nodes, gone), req))
    assert result.reason.startswith("replica 2 of 2: m needs 10.00 GiB")
    assert result.available_bytes == {"a:cpu": 8 * GiB}


def test_placing_again_under_a_spec_keeps_only_replicas_where_the_spec_puts_them() -> None:
    cluster = view(node("a", 10 * GiB), node("b", 10 * GiB))
    spec = chat(["a:cpu", "b:cpu"], replicas=2)
    first = placement(place(cluster, ask(model(size=GiB), spec=spec)))
    swapped = chat(["b:cpu", "a:cpu"], replicas=2)
    again = placement(
        place(cluster, ask(model(size=GiB), spec=swapped, generation=2, current=first.shards))
    )
    assert again.kept_replicas == ()
    assert layout(again.shards) == [(0, 0, "b:cpu", 0, 32), (1, 0, "a:cpu", 0, 32)]
    same = placement(
        place(cluster, ask(model(size=GiB), spec=spec, generation=2, current=first.shards))
    )
    assert same.kept_replicas == (0, 1)
    assert same.shards == first.shards


# --- properties ---------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> list[Event | list[Event]]:
    count = draw(st.integers(min_value=1, max_value=5))
    nodes: list[Event | list[Event]] = []
    for i in range(count):
        offered = draw(st.integers(min_value=1, max_value=40 * 1024)) * MiB
        gpu_sizes = draw(st.lists(st.integers(min_value=1, max_value=24 * 1024), max_size=2))
        gpus = [gpu(k, size * MiB) for k, size in enumerate(gpu_sizes)]
        cards = draw(st.lists(st.integers(min_value=1, max_value=24 * 1024), max_size=2))
        unified = draw(st.booleans())
        backend: AcceleratorBackend = "metal" if unified else "cuda"
        accelerators = [
            accelerator(backend, k, size * MiB, unified=unified) for k, size in enumerate(cards)
        ]
        nodes.append(node(f"n{i}", offered, gpus=gpus, accelerators=accelerators))
    return nodes


@settings(max_examples=150, deadline=None, database=None)
@given(
    clusters(),
    st.integers(min_value=1, max_value=48),
    st.integers(min_value=1, max_value=120 * 1024),
    st.integers(min_value=0, max_value=512 * 1024),
    st.integers(min_value=0, max_value=2 * 1024),
    st.integers(min_value=1, max_value=3),
)
def test_every_placement_covers_each_replicas_layers_within_usable_memory(
    nodes: list[Event | list[Event]],
    n_layers: int,
    size_mib: int,
    kv: int,
    overhead_mib: int,
    replicas: int,
) -> None:
    cluster = view(*nodes)
    added = model(size=size_mib * MiB, n_layers=n_layers, kv=kv, overhead=overhead_mib * MiB)
    result = place(cluster, ask(added, replicas=replicas))
    need = size_mib * MiB + kv * 2048 + overhead_mib * MiB
    if not isinstance(result, Placement):
        assert result.needed_bytes == need
        if replicas == 1:
            # Rejected only when no single device could take the whole model.
            assert all(d.usable < need for d in cluster.devices.values())
        return
    assert result.need_bytes == need
    by_replica: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    per_device: dict[str, int] = defaultdict(int)
    for s in result.shards:
        by_replica[s.replica].append((s.rank, s.start_layer, s.end_layer, s.world_size))
        assert s.n_layers == n_layers
        assert f"{s.node_id}:{s.device}" in cluster.devices
        assert sum(n for _, n in device_layers(s)) == s.end_layer - s.start_layer
        shard_bytes = 0
        for device, n in device_layers(s):
            per_device[f"{s.node_id}:{device}"] += info(added).footprint.need_bytes(2048, n)
            shard_bytes += info(added).footprint.need_bytes(2048, n)
        assert shard_bytes == result.shard_bytes[s.runner_id]
    assert sorted(by_replica) == list(range(replicas))
    for stages in by_replica.values():
        stages.sort()
        assert [rank for rank, *_ in stages] == list(range(len(stages)))
        assert {size for *_, size in stages} == {len(stages)}
        assert stages[0][1] == 0 and stages[-1][2] == n_layers
        for before, after in pairwise(stages):
            assert before[2] == after[1]
        assert all(end > start for _, start, end, _ in stages)
    reserved = cluster.reserve(result.charges)  # a unified GPU's and its CPU's together
    assert all(d.usable >= 0 for d in reserved.devices.values()), reserved.devices
    assert per_device == result.charges
    assert sum(result.charges.values()) >= replicas * need
