"""The worker's pure decisions."""

from __future__ import annotations

import signal

from events.catalogue import InstanceDeleteRequested, InstancePlaced, InstanceRequested
from events.records import ShardAssignment
from projectors.rules import fold
from services.worker.reconcile import (
    describe_exit,
    desired_runners,
    plan,
    restart_delay,
    runner_slots,
)


def _placed(instance: str, nodes: list[str]) -> InstancePlaced:
    return InstancePlaced(
        instance_id=instance,
        model_id="m",
        origin="p",
        shards=[
            ShardAssignment(
                runner_id=f"{instance}-{i}",
                node_id=n,
                rank=i,
                world_size=len(nodes),
                start_layer=i,
                end_layer=i + 1,
                n_layers=len(nodes),
            )
            for i, n in enumerate(nodes)
        ],
    )


def test_desired_runners_are_this_nodes_placed_shards() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i1", model_id="m", origin="api"),
            _placed("i1", ["a", "b"]),
            InstanceRequested(instance_id="i2", model_id="m", origin="api"),
            _placed("i2", ["a"]),
            InstanceDeleteRequested(instance_id="i2", origin="api"),
        ]
    )
    assert set(desired_runners(state, "a")) == {"i1-0"}  # i2 is being deleted
    assert set(desired_runners(state, "b")) == {"i1-1"}
    assert desired_runners(state, "c") == {}


def test_plan() -> None:
    p = plan({"r1": 1, "r2": 2}, ["r2", "r3"])
    assert (p.start, p.stop) == (frozenset({"r1"}), frozenset({"r3"}))
    assert plan({}, []).start == frozenset()


def test_runner_slots_are_the_placements_unless_the_worker_says() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i", model_id="m", origin="api"),
            _placed("i", ["a"]).model_copy(update={"slots": 4}),
            InstanceRequested(instance_id="old", model_id="m", origin="api"),
            _placed("old", ["a"]),  # logged before slots were
        ]
    )
    placed = {i: row.slots for i in ("i", "old") if (row := state.instance(i)) is not None}
    assert [runner_slots(placed["i"]), runner_slots(placed["old"])] == [4, 1]
    assert [runner_slots(placed["i"], 2), runner_slots(placed["old"], 2)] == [2, 2]


def test_restart_delay_is_bounded() -> None:
    delays = [restart_delay(n) for n in range(0, 12)]
    assert delays[:5] == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert max(delays) == 30.0 and delays == sorted(delays)


def test_describe_exit() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"
