"""Slots: how many tasks each replica serves at once, each with a KV cache of the whole
context. Placement gives what was asked for, or else as many as fit (up to 8) on the devices
it would choose for one; the memory placed shards hold counts every slot.

The model here has 2 GiB of weights and 1 GiB of KV cache per slot at its default context
(512 KiB a token, 2048 tokens), so a replica of ``n`` slots needs ``2 + n`` GiB.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from events.catalogue import Event, InstancePlaced, ModelAdded, PlacementRejected
from events.units import GiB
from services.models.footprint import DEFAULT_MAX_SLOTS
from services.planner.placement import PlacementRequest, place
from tests.services.planner.builders import (
    ask,
    fold_all,
    gpu,
    layout,
    model,
    node,
    placed,
    placement,
    rejection,
    request,
    runner_state,
    settle,
    shard,
    view,
)

KV = GiB // 2048  # bytes per token: 1 GiB per slot at the default context


def two_gib() -> ModelAdded:
    return model(size=2 * GiB, kv=KV)


def auto(added: ModelAdded, **kw: Any) -> PlacementRequest:
    """A request that names no slots."""
    return ask(added, slots=None, **kw)


def spec(devices: list[str], **extra: object) -> str:
    return json.dumps({"chat": {"devices": devices, **extra}})


# --- chosen at placement ------------------------------------------------------------------


def test_the_most_slots_that_fit_beside_the_weights() -> None:
    # 9 GiB usable: 2 GiB of weights and 7 slots of 1 GiB.
    result = placement(place(view(node("a", 10 * GiB)), auto(two_gib())))
    assert result.slots == 7
    assert result.need_bytes == 9 * GiB
    assert result.charges == {"a:cpu": 9 * GiB}
    assert result.shard_bytes == {"i-g1-r0-s0": 9 * GiB}


def test_no_more_than_the_default_maximum() -> None:
    result = placement(place(view(node("a", 100 * GiB)), auto(two_gib())))
    assert result.slots == DEFAULT_MAX_SLOTS == 8
    assert result.need_bytes == 10 * GiB


def test_at_least_one_slot_and_rejected_as_before_when_one_does_not_fit() -> None:
    assert placement(place(view(node("a", 4 * GiB)), auto(two_gib()))).slots == 1  # 3.6 usable
    reason = rejection(place(view(node("a", 3 * GiB)), auto(two_gib()))).reason
    assert reason.startswith(
        "m needs 3.00 GiB for a context of 2048 tokens (weights 2.00 GiB, KV cache 1.00 GiB,"
    )


def test_devices_are_chosen_for_one_slot_then_filled() -> None:
    # The GPU holds one slot (3.6 GiB usable); the CPU would hold eight: the GPU wins.
    cluster = view(node("a", 20 * GiB, gpus=[gpu(0, 4 * GiB)]))
    result = placement(place(cluster, auto(two_gib())))
    assert layout(result.shards) == [(0, 0, "a:gpu0", 0, 32)]
    assert result.slots == 1


def test_replicas_on_one_device_share_its_room() -> None:
    # Two replicas on 18 GiB: 2 x (2 + n) <= 18, n = 7.
    one_device = spec(["a:cpu"], replicas=2)
    result = placement(place(view(node("a", 20 * GiB)), auto(two_gib(), spec=one_device)))
    assert len(result.shards) == 2 and result.slots == 7
    assert result.charges == {"a:cpu": 18 * GiB}


def test_every_stage_of_a_pipeline_fits_its_share() -> None:
    # 12 GiB of weights over two nodes of 9 GiB: half the layers each, (12 + n) / 2 <= 9.
    added = model(size=12 * GiB, n_layers=4, kv=KV)
    result = placement(place(view(node("a", 10 * GiB), node("b", 10 * GiB)), auto(added)))
    assert [(s.node_id, s.end_layer - s.start_layer) for s in result.shards] == [
        ("a", 2),
        ("b", 2),
    ]
    assert result.slots == 6
    assert sorted(result.shard_bytes.values()) == [9 * GiB, 9 * GiB]


def test_embed_instances_have_one_slot_and_mlx_rings_batch() -> None:
    cluster = view(node("a", 100 * GiB))
    embed = replace(auto(two_gib()), role="embed")
    assert placement(place(cluster, embed)).slots == 1
    mlx = auto(two_gib())
    assert mlx.model is not None
    mlx = replace(mlx, model=replace(mlx.model, engine="mlx"))
    assert placement(place(cluster, mlx)).slots == 8  # a whole MLX model batches
    # Split over two nodes (a ring), as many as fit, as a llama.cpp pipeline.
    two = view(node("a", 3 * GiB), node("b", 3 * GiB))
    split = placement(place(two, mlx))
    assert len(split.shards) == 2 and split.slots == 3
    assert placement(place(two, auto(two_gib()))).slots == 3
    assert placement(place(two, replace(mlx, slots=2))).slots == 2
    reason = rejection(place(cluster, replace(embed, slots=4))).reason
    assert reason == "an embed instance serves one task at a time: slots must be 1, not 4"


def test_slots_times_the_context_stays_within_what_an_engine_takes() -> None:
    huge = 2**30  # tokens: two slots of it are more than a 32-bit context
    added = model(size=GiB, kv=0)
    cluster = view(node("a", 100 * GiB))
    assert placement(place(cluster, auto(added, context_length=huge))).slots == 1
    reason = rejection(place(cluster, ask(added, context_length=huge, slots=2))).reason
    assert reason == f"2 slots of {huge} tokens are more than any engine takes"


# --- asked for ----------------------------------------------------------------------------


def test_asked_for_slots_are_given_exactly() -> None:
    result = placement(place(view(node("a", 10 * GiB)), ask(two_gib(), slots=3)))
    assert result.slots == 3 and result.need_bytes == 5 * GiB


def test_asked_for_slots_that_do_not_fit_are_rejected_saying_so() -> None:
    reason = rejection(place(view(node("a", 10 * GiB)), ask(two_gib(), slots=8))).reason
    assert reason.startswith(
        "m needs 10.00 GiB for a context of 2048 tokens for each of 8 slots (weights 2.00 GiB,"
        " KV cache 8.00 GiB,"
    )
    for bad in (0, 65):
        reason = rejection(place(view(node("a", 10 * GiB)), ask(two_gib(), slots=bad))).reason
        assert reason == f"slots must be between 1 and 64, not {bad}"


def test_a_placement_spec_may_name_the_slots() -> None:
    cluster = view(node("a", 10 * GiB))
    result = placement(place(cluster, auto(two_gib(), spec=spec(["a:cpu"], slots=2))))
    assert result.slots == 2
    # The spec's slots are the instance's; the API refuses a request that says otherwise.
    result = placement(place(cluster, ask(two_gib(), spec=spec(["a:cpu"], slots=2), slots=5)))
    assert result.slots == 2
    reason = rejection(place(cluster, auto(two_gib(), spec=spec(["a:cpu"], slots=9)))).reason
    assert reason.startswith("a:cpu: its share (the whole model) needs 11.00 GiB")


# --- placed again -------------------------------------------------------------------------


def test_placed_again_the_kept_runners_keep_their_slots() -> None:
    current = [shard("i-g1-r0-s0", "a", (0, 32), 32)]
    cluster = view(node("a", 100 * GiB), node("b", 100 * GiB))
    again = auto(two_gib(), replicas=2, current=current, current_slots=2, generation=2)
    result = placement(place(cluster, again))
    assert result.kept_replicas == (0,) and result.slots == 2  # not 8: runner 0 goes on
    assert [s.runner_id for s in result.shards] == ["i-g1-r0-s0", "i-g2-r1-s0"]
    # Placed before slots were: one.
    old_log = replace(again, current_slots=None)
    assert placement(place(cluster, old_log)).slots == 1
    # Fewer when fewer fit now.
    small = view(node("a", 10 * GiB), node("b", 100 * GiB))
    assert placement(place(small, replace(again, current_slots=8))).slots == 7


# --- memory held, and the planner's decisions ---------------------------------------------


def test_a_placed_shard_holds_a_kv_cache_for_each_slot() -> None:
    base: list[Event | list[Event]] = [
        node("a", 20 * GiB),
        two_gib(),
        request("i"),
        placed("i", [shard("i-1", "a", (0, 32), 32)], slots=4),
    ]
    assert view(*base).devices["a:cpu"].reserved == 2 * GiB + 4 * GiB
    # What the runner says it serves counts (a worker's --slots may have changed it).
    ready = runner_state("i-1", "i", "a", "Ready", t=3).model_copy(update={"slots": 2})
    assert view(*base, ready).devices["a:cpu"].reserved == 2 * GiB + 2 * GiB
    # Placed before slots were: one.
    old = [*base[:3], placed("i", [shard("i-1", "a", (0, 32), 32)])]
    assert view(*old).devices["a:cpu"].reserved == 2 * GiB + 1 * GiB


def test_the_planner_records_the_slots_it_chose_and_counts_them() -> None:
    state = fold_all(node("a", 20 * GiB), two_gib(), request("one"), request("two", slots=3, t=2))
    decisions = settle(state, 3)
    first, second = (d.event for d in decisions)
    assert isinstance(first, InstancePlaced) and first.slots == 8  # 10 of 18 GiB
    assert isinstance(second, InstancePlaced) and second.slots == 3  # 5 of the 8 left
    one, two = state.instance("one"), state.instance("two")
    assert one is not None and (one.requested_slots, one.slots) == (None, 8)
    assert two is not None and (two.requested_slots, two.slots) == (3, 3)
    # 3 GiB are left: a third instance gets one slot, a fourth none.
    fold_all(request("three", t=4), request("four", slots=2, t=5), state=state)
    third, fourth = (d.event for d in settle(state, 6))
    assert isinstance(third, InstancePlaced) and third.slots == 1
    assert isinstance(fourth, PlacementRejected)
    assert "for each of 2 slots" in fourth.reason
