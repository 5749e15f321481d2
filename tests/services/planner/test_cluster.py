"""The cluster as placement sees it: online devices, 90% of what is offered, less what is
placed."""

from __future__ import annotations

from events.catalogue import Event, InstanceDeleted, InstanceDeleteRequested, NodeLeft, NodeTimedOut
from events.units import GiB, MiB
from services.planner.cluster import ClusterView, Device, cluster_view
from tests.services.planner.builders import (
    at,
    fold_all,
    gpu,
    heartbeat,
    model,
    node,
    placed,
    request,
    shard,
    usable,
    usable_of,
    view,
)


def test_a_cpu_offers_what_the_node_offers_less_ten_percent() -> None:
    cluster = view(node("a", 10 * GiB), node("b", 20 * GiB))
    assert usable_of(cluster) == {"a:cpu": 9 * GiB, "b:cpu": 18 * GiB}
    a = cluster.devices["a:cpu"]
    # The node's RAM (twice the offer in these tests) does not count: only the offer does.
    assert (a.node_id, a.device, a.kind, a.capacity, a.reserved) == ("a", "cpu", "cpu", 10 * GiB, 0)
    assert cluster.node_status == {"a": "online", "b": "online"}


def test_usable_memory_is_rounded_down_to_whole_bytes() -> None:
    cluster = view(node("a", 1000), node("b", 7 * GiB + 3))
    assert usable_of(cluster) == {"a:cpu": 900, "b:cpu": usable(7 * GiB + 3)}
    assert usable(7 * GiB + 3) == (7 * GiB + 3) * 9 // 10


def test_a_gpu_offers_its_whole_memory_less_ten_percent() -> None:
    cluster = view(node("a", 10 * GiB, gpus=[gpu(0, 24 * GiB), gpu(1, 8 * GiB)]))
    assert usable_of(cluster) == {
        "a:cpu": 9 * GiB,
        "a:gpu0": usable(24 * GiB),
        "a:gpu1": usable(8 * GiB),
    }
    assert cluster.devices["a:gpu1"].kind == "gpu"
    assert cluster.devices["a:gpu1"].capacity == 8 * GiB
    assert [d.device for d in cluster.devices_of("a")] == ["cpu", "gpu0", "gpu1"]


def test_a_gpu_that_disappears_from_the_profile_is_no_longer_a_device() -> None:
    cluster = view(node("a", 10 * GiB, gpus=[gpu(0, 24 * GiB)]), heartbeat("a", 10 * GiB, t=5))
    assert sorted(cluster.devices) == ["a:cpu"]


def test_nodes_that_timed_out_or_left_have_no_devices_but_keep_their_status() -> None:
    cluster = view(
        node("a", 10 * GiB),
        node("b", 10 * GiB),
        node("c", 10 * GiB, gpus=[gpu(0, 8 * GiB)]),
        NodeTimedOut(node_id="b", origin="planner", ts=at(9), last_seen=at(0), missed_heartbeats=3),
        NodeLeft(node_id="c", origin="c", ts=at(9)),
    )
    assert sorted(cluster.devices) == ["a:cpu"]
    assert cluster.node_status == {"a": "online", "b": "timed_out", "c": "left"}
    assert cluster.devices_of("c") == []


def test_a_node_back_from_a_time_out_offers_its_devices_again() -> None:
    cluster = view(
        node("a", 10 * GiB),
        NodeTimedOut(node_id="a", origin="planner", ts=at(9), last_seen=at(0), missed_heartbeats=3),
        heartbeat("a", 20 * GiB, t=10),
    )
    assert usable_of(cluster) == {"a:cpu": 18 * GiB}


def test_no_nodes_no_devices() -> None:
    cluster = view(model(size=GiB))
    assert cluster.devices == {}
    assert cluster.node_status == {}


# --- memory held by placed shards ---------------------------------------------------------


def test_placed_shards_hold_their_share_of_the_model() -> None:
    state = fold_all(
        node("a", 20 * GiB),
        node("b", 20 * GiB),
        model("small", size=4 * GiB, n_layers=8),
        model("big", size=6 * GiB, n_layers=4),
        request("x", "small"),
        request("y", "big"),
        placed("x", [shard("x-1", "a", (0, 8), 8)], model_id="small"),
        placed(
            "y",
            [
                shard("y-1", "a", (0, 2), 4, rank=0, world_size=2),
                shard("y-2", "b", (2, 4), 4, rank=1, world_size=2),
            ],
            model_id="big",
        ),
    )
    cluster = cluster_view(state)
    assert cluster.devices["a:cpu"].reserved == 4 * GiB + 3 * GiB
    assert cluster.devices["b:cpu"].reserved == 3 * GiB
    assert usable_of(cluster) == {"a:cpu": 18 * GiB - 7 * GiB, "b:cpu": 18 * GiB - 3 * GiB}
    # The instance being placed again does not count against itself.
    assert usable_of(cluster_view(state, excluding_instance="y")) == {
        "a:cpu": 14 * GiB,
        "b:cpu": 18 * GiB,
    }
    assert usable_of(cluster_view(state, excluding_instance="x")) == {
        "a:cpu": 15 * GiB,
        "b:cpu": 15 * GiB,
    }


def test_a_shard_holds_its_kv_cache_and_engine_overhead_too() -> None:
    # 8 GiB of weights + 512 KiB/token x 2048 tokens (1 GiB) over 3 layers, + 256 MiB engine.
    cluster = view(
        node("a", 20 * GiB),
        node("b", 20 * GiB),
        model(size=8 * GiB, n_layers=3, kv=512 * 1024, overhead=256 * MiB),
        request("i"),
        placed(
            "i",
            [
                shard("i-1", "a", (0, 2), 3, rank=0, world_size=2),
                shard("i-2", "b", (2, 3), 3, rank=1, world_size=2),
            ],
        ),
    )
    body = 9 * GiB
    assert cluster.devices["a:cpu"].reserved == -(-body * 2 // 3) + 256 * MiB
    assert cluster.devices["b:cpu"].reserved == -(-body // 3) + 256 * MiB


def test_the_requested_context_sets_the_kv_cache_a_shard_holds() -> None:
    cluster = view(
        node("a", 20 * GiB),
        model(size=2 * GiB, n_layers=4, kv=GiB // 4096, context_length=8192),
        request("i", context_length=8192),
        placed("i", [shard("i-1", "a", (0, 4), 4)]),
    )
    assert cluster.devices["a:cpu"].reserved == 2 * GiB + 2 * GiB


def test_only_placed_and_deleting_instances_hold_memory() -> None:
    base: list[Event | list[Event]] = [
        node("a", 20 * GiB),
        model(size=4 * GiB, n_layers=8),
        request("i"),
        placed("i", [shard("i-1", "a", (0, 8), 8)]),
    ]
    assert usable_of(view(*base)) == {"a:cpu": 14 * GiB}
    deleting = InstanceDeleteRequested(instance_id="i", origin="cli", ts=at(5))
    assert usable_of(view(*base, deleting)) == {"a:cpu": 14 * GiB}
    deleted = InstanceDeleted(instance_id="i", origin="planner", ts=at(6))
    assert usable_of(view(*base, deleting, deleted)) == {"a:cpu": 18 * GiB}
    # Requested but not placed: nothing held.
    assert usable_of(view(*base[:3])) == {"a:cpu": 18 * GiB}


def test_shards_on_an_offline_node_hold_nothing_anywhere() -> None:
    cluster = view(
        node("a", 20 * GiB),
        node("b", 20 * GiB),
        model(size=4 * GiB, n_layers=8),
        request("i"),
        placed("i", [shard("i-1", "a", (0, 8), 8)]),
        NodeLeft(node_id="a", origin="a", ts=at(5)),
    )
    assert usable_of(cluster) == {"b:cpu": 18 * GiB}


def test_reserve_charges_a_new_view_and_leaves_the_old_one_alone() -> None:
    cluster = view(node("a", 10 * GiB, gpus=[gpu(0, 10 * GiB)]))
    after = cluster.reserve({"a:cpu": 2 * GiB, "a:gpu0": 10 * GiB})
    assert usable_of(after) == {"a:cpu": 7 * GiB, "a:gpu0": -GiB}
    assert usable_of(after.reserve({"a:cpu": GiB})) == {"a:cpu": 6 * GiB, "a:gpu0": -GiB}
    assert usable_of(cluster) == {"a:cpu": 9 * GiB, "a:gpu0": 9 * GiB}
    assert after.node_status == cluster.node_status


def test_device_usable_is_ninety_percent_of_capacity_less_reserved() -> None:
    device = Device("n", "gpu1", "gpu", capacity=10 * GiB, reserved=GiB)
    assert device.ref == "n:gpu1"
    assert device.usable == 8 * GiB
    assert ClusterView({device.ref: device}, {"n": "online"}).devices_of("n") == [device]
