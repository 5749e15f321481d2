"""What the planner decides, from the projection and the time: time-outs, deletions,
placements, and placing again when nodes go or runners keep failing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from events.catalogue import (
    Event,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    NodeLeft,
    NodeTimedOut,
    PlacementRejected,
)
from events.units import GiB
from projectors.state import ClusterState
from services.planner.decisions import (
    Decision,
    PlannerPolicy,
    decide,
    heartbeat_may_matter,
    next_timeout,
)
from tests.services.planner.builders import (
    POLICY,
    Where,
    at,
    failures,
    fold_all,
    heartbeat,
    layout,
    model,
    node,
    request,
    runner_state,
    settle,
    usable,
)


def runner_layout(state: ClusterState, instance_id: str) -> list[Where]:
    """Where the projection says the instance's runners are."""
    return sorted(
        (r.replica, r.rank, f"{r.node_id}:{r.device}", r.start_layer, r.end_layer)
        for r in state.runners_of(instance_id)
    )


def msg_ids(decisions: list[Decision]) -> list[str]:
    return [d.msg_id for d in decisions]


def the(kind: type[Any], decisions: list[Decision]) -> Any:
    """The one decision of type ``kind``."""
    (event,) = [d.event for d in decisions if isinstance(d.event, kind)]
    return event


def comparable(decisions: list[Decision]) -> list[tuple[str, dict[str, Any]]]:
    """Decisions without what is unique to each event (its id and the time it was made)."""
    return [(d.msg_id, d.event.model_dump(exclude={"event_id", "ts"})) for d in decisions]


def placed_on_a() -> ClusterState:
    """Nodes a (18 GiB usable) and b (13.5), heartbeats every 10 s; an 8 GiB model placed
    on a at t=2 (runner i-g1-r0-s0)."""
    state = fold_all(node("a", 20 * GiB), node("b", 15 * GiB), model(size=8 * GiB), request())
    assert msg_ids(settle(state, 2)) == ["placement:i:1"]
    assert runner_layout(state, "i") == [(0, 0, "a:cpu", 0, 32)]
    return state


# --- node time-outs -----------------------------------------------------------------------


def test_a_silent_node_times_out_after_missed_heartbeats_and_not_before() -> None:
    state = fold_all(node("a", 10 * GiB, heartbeat_s=5))
    assert decide(state, at(14.999), POLICY) == []
    (decision,) = decide(state, at(15), POLICY)
    assert decision.msg_id == "timedout:a:2025-01-01T00:00:00+00:00"
    event = decision.event
    assert isinstance(event, NodeTimedOut)
    assert (event.node_id, event.last_seen, event.missed_heartbeats) == ("a", at(0), 3)
    assert event.origin == "planner"


def test_a_node_that_gave_no_interval_times_out_after_the_policy_default() -> None:
    state = fold_all(node("a", 10 * GiB, heartbeat_s=None))
    assert decide(state, at(5.999), POLICY) == []
    assert msg_ids(decide(state, at(6), POLICY)) == ["timedout:a:2025-01-01T00:00:00+00:00"]
    patient = PlannerPolicy(missed_heartbeats=5, default_heartbeat_s=3.0)
    assert decide(state, at(14.9), patient) == []
    assert the(NodeTimedOut, decide(state, at(15), patient)).missed_heartbeats == 5


def test_missed_heartbeats_counts_every_interval_missed() -> None:
    state = fold_all(node("a", 10 * GiB, heartbeat_s=5))
    assert the(NodeTimedOut, decide(state, at(101), POLICY)).missed_heartbeats == 20


def test_silence_while_the_log_could_not_be_heard_does_not_count() -> None:
    """The log was unreachable until t=20 (a stream electing a new leader): the node's
    heartbeats could not be stored, so its silence counts from then."""
    state = fold_all(node("a", 10 * GiB, heartbeat_s=5))
    assert decide(state, at(34.9), POLICY, heard_since=at(20)) == []
    late = the(NodeTimedOut, decide(state, at(35), POLICY, heard_since=at(20)))
    assert (late.last_seen, late.missed_heartbeats) == (at(0), 3)
    # Heard since before the last heartbeat: the heartbeat is what counts.
    assert decide(state, at(14.9), POLICY, heard_since=at(-10)) == []


def test_each_heartbeat_restarts_the_count_and_names_the_time_out() -> None:
    state = fold_all(node("a", 10 * GiB, heartbeat_s=5), heartbeat("a", 10 * GiB, t=10))
    assert decide(state, at(24.9), POLICY) == []
    assert msg_ids(decide(state, at(25), POLICY)) == ["timedout:a:2025-01-01T00:00:10+00:00"]


def test_a_timed_out_node_is_timed_out_once() -> None:
    state = fold_all(node("a", 10 * GiB, heartbeat_s=5), node("b", 10 * GiB, heartbeat_s=60))
    assert msg_ids(settle(state, 15)) == ["timedout:a:2025-01-01T00:00:00+00:00"]
    node_a = state.node("a")
    assert node_a is not None and node_a.status == "timed_out"
    assert settle(state, 100) == []


def test_the_next_time_out_is_when_decide_would_first_time_a_node_out() -> None:
    """A planner with nothing to do sleeps until then: the moment must match ``decide``."""
    state = fold_all(
        node("a", 10 * GiB, heartbeat_s=5),
        node("b", 10 * GiB, heartbeat_s=2),
        heartbeat("b", 10 * GiB, t=10),
    )
    deadline = next_timeout(state, POLICY)
    assert deadline == at(15)  # a: 3 x 5 s after t=0 (b: 3 x 2 s after t=10)
    assert decide(state, deadline - timedelta(milliseconds=1), POLICY) == []
    assert msg_ids(decide(state, deadline, POLICY)) == ["timedout:a:2025-01-01T00:00:00+00:00"]
    assert next_timeout(state, POLICY, heard_since=at(20)) == at(26)  # silence counts from 20
    settle(state, 100)
    assert next_timeout(state, POLICY) is None  # no online node left to watch


def test_a_heartbeat_matters_only_to_a_node_not_online_or_an_instance_waiting() -> None:
    state = placed_on_a()
    assert not heartbeat_may_matter(state, "a") and not heartbeat_may_matter(state, "b")
    assert heartbeat_may_matter(state, "c")  # not known yet
    fold_all(
        NodeTimedOut(node_id="b", origin="planner", last_seen=at(0), missed_heartbeats=3, ts=at(3)),
        state=state,
    )
    assert heartbeat_may_matter(state, "b")  # it comes back
    # An instance waiting for a place: more free memory on any node may make it fit.
    fold_all(model("big", size=30 * GiB), request("j", "big", t=3), state=state)
    assert heartbeat_may_matter(state, "a")
    assert msg_ids(settle(state, 4)) == ["placement:j:1"]  # rejected: it still waits
    assert state.instance("j").status == "rejected"  # type: ignore[union-attr]
    assert heartbeat_may_matter(state, "a")


def test_a_node_that_left_is_not_timed_out() -> None:
    state = fold_all(node("a", 10 * GiB), NodeLeft(node_id="a", origin="a", ts=at(1)))
    assert decide(state, at(1000), POLICY) == []


# --- placing requested instances ----------------------------------------------------------


def test_a_requested_instance_is_placed_once() -> None:
    state = fold_all(node("a", 20 * GiB), node("b", 10 * GiB), model(size=8 * GiB), request())
    decisions = settle(state, 2)
    assert msg_ids(decisions) == ["placement:i:1"]
    event = the(InstancePlaced, decisions)
    assert (event.instance_id, event.model_id, event.generation) == ("i", "m", 1)
    assert (event.reason, event.avoid) == ("", [])
    assert layout(event.shards) == [(0, 0, "a:cpu", 0, 32)]
    inst = state.instance("i")
    assert inst is not None
    assert (inst.status, inst.generation, inst.placements) == ("placed", 1, 1)
    assert runner_layout(state, "i") == [(0, 0, "a:cpu", 0, 32)]
    # The decision is in the projection: nothing more to decide, however often asked.
    assert settle(state, 3) == []
    assert settle(state, 4) == []


def test_decide_does_not_change_the_state_it_is_given() -> None:
    state = fold_all(node("a", 20 * GiB, heartbeat_s=5), model(size=8 * GiB), request())
    before = {name: dict(rows) for name, rows in state.tables.items()}
    assert len(decide(state, at(20), POLICY)) == 2
    assert state.tables == before


def test_deciding_twice_on_the_same_state_decides_the_same() -> None:
    state = fold_all(
        node("a", 20 * GiB, heartbeat_s=5),
        node("b", 20 * GiB, heartbeat_s=60),
        node("c", GiB, heartbeat_s=60),
        model(size=8 * GiB),
        model("huge", size=100 * GiB),
        request("i"),
        request("j", "huge"),
    )
    first = decide(state, at(20), POLICY)
    assert msg_ids(first) == [
        "timedout:a:2025-01-01T00:00:00+00:00",
        "placement:i:1",
        "placement:j:1",
    ]
    assert comparable(decide(state, at(20), POLICY)) == comparable(first)
    assert comparable(decide(state.copy(), at(20), POLICY)) == comparable(first)


def test_decisions_are_stamped_with_the_time_they_were_decided_for() -> None:
    state = fold_all(node("a", 20 * GiB, heartbeat_s=5), model(size=8 * GiB), request())
    decisions = decide(state, at(20), POLICY)
    assert [d.event.ts for d in decisions] == [at(20), at(20)]


def test_an_unknown_model_is_rejected_then_placed_once_it_is_added() -> None:
    state = fold_all(node("a", 20 * GiB), request("i", "ghost"))
    decisions = settle(state, 2)
    assert msg_ids(decisions) == ["placement:i:1"]
    rejected = the(PlacementRejected, decisions)
    assert rejected.reason == (
        "model 'ghost' is not known to the cluster: add it with `shoal models add ghost`"
    )
    assert (rejected.needed_bytes, rejected.generation) == (None, 1)
    assert settle(state, 3) == []
    fold_all(model("ghost", size=GiB, t=4), state=state)
    decisions = settle(state, 5)
    assert msg_ids(decisions) == ["placement:i:2"]
    assert layout(the(InstancePlaced, decisions).shards) == [(0, 0, "a:cpu", 0, 32)]


def test_instances_are_placed_in_request_order_each_seeing_the_ones_before() -> None:
    # Room for one 10 GiB model (on a): the earlier request gets it, whatever the ids.
    state = fold_all(
        node("a", 20 * GiB),
        node("b", 2 * GiB),
        model(size=10 * GiB),
        request("zz-early", t=1),
        request("aa-late", t=2),
    )
    decisions = settle(state, 3)
    assert msg_ids(decisions) == ["placement:zz-early:1", "placement:aa-late:1"]
    assert layout(the(InstancePlaced, decisions).shards) == [(0, 0, "a:cpu", 0, 32)]
    rejected = the(PlacementRejected, decisions)
    assert rejected.instance_id == "aa-late"
    assert rejected.available_bytes == {"a:cpu": 8 * GiB, "b:cpu": usable(2 * GiB)}


def test_a_rejected_instance_is_told_once_and_placed_when_a_node_joins() -> None:
    state = fold_all(node("a", 5 * GiB), model(size=8 * GiB), request())
    decisions = settle(state, 2)
    assert msg_ids(decisions) == ["placement:i:1"]
    rejected = the(PlacementRejected, decisions)
    assert rejected.reason.startswith("m needs 8.00 GiB for a context of 2048 tokens")
    assert (rejected.needed_bytes, rejected.available_bytes) == (
        8 * GiB,
        {"a:cpu": usable(5 * GiB)},
    )
    inst = state.instance("i")
    assert inst is not None and (inst.status, inst.generation) == ("rejected", 1)
    # Not rejected again at every round.
    assert settle(state, 3) == []
    assert settle(state, 10) == []
    fold_all(node("b", 20 * GiB, t=11), state=state)
    decisions = settle(state, 12)
    assert msg_ids(decisions) == ["placement:i:2"]
    assert layout(the(InstancePlaced, decisions).shards) == [(0, 0, "b:cpu", 0, 32)]
    assert settle(state, 13) == []


# --- deleting -----------------------------------------------------------------------------


def test_an_instance_being_deleted_is_deleted_once() -> None:
    state = placed_on_a()
    fold_all(
        InstanceDeleteRequested(instance_id="i", origin="cli", ts=at(3), reason="not needed"),
        state=state,
    )
    decisions = settle(state, 4)
    assert msg_ids(decisions) == ["deleted:i"]
    deleted = the(InstanceDeleted, decisions)
    assert (deleted.instance_id, deleted.reason) == ("i", "not needed")
    inst = state.instance("i")
    assert inst is not None and inst.status == "deleted"
    assert runner_layout(state, "i") == []
    assert settle(state, 5) == []


def test_memory_freed_by_a_deletion_is_placed_on_in_the_same_round() -> None:
    state = fold_all(node("a", 10 * GiB), model(size=8 * GiB), request("x"))
    assert msg_ids(settle(state, 2)) == ["placement:x:1"]
    fold_all(
        InstanceDeleteRequested(instance_id="x", origin="cli", ts=at(3)),
        request("y", t=3),
        state=state,
    )
    decisions = settle(state, 4)
    assert msg_ids(decisions) == ["deleted:x", "placement:y:1"]
    assert layout(the(InstancePlaced, decisions).shards) == [(0, 0, "a:cpu", 0, 32)]


# --- nodes that go ------------------------------------------------------------------------


def test_an_instance_on_a_timed_out_node_is_placed_again_on_the_remaining_node() -> None:
    state = placed_on_a()
    fold_all(heartbeat("b", 15 * GiB, t=25), state=state)
    decisions = settle(state, 30)
    assert msg_ids(decisions) == ["timedout:a:2025-01-01T00:00:00+00:00", "placement:i:2"]
    again = the(InstancePlaced, decisions)
    assert (again.generation, again.reason) == (2, "node a is timed out")
    assert layout(again.shards) == [(0, 0, "b:cpu", 0, 32)]
    assert [s.runner_id for s in again.shards] == ["i-g2-r0-s0"]
    assert runner_layout(state, "i") == [(0, 0, "b:cpu", 0, 32)]
    assert settle(state, 31) == []


def test_an_instance_on_a_node_that_left_is_placed_again() -> None:
    state = placed_on_a()
    fold_all(NodeLeft(node_id="a", origin="a", ts=at(5)), state=state)
    again = the(InstancePlaced, settle(state, 6))
    assert again.reason == "node a is left"
    assert layout(again.shards) == [(0, 0, "b:cpu", 0, 32)]
    assert settle(state, 7) == []


def test_an_instance_that_no_longer_fits_is_rejected_and_placed_when_its_node_returns() -> None:
    state = fold_all(node("a", 20 * GiB), node("b", 5 * GiB), model(size=8 * GiB), request())
    settle(state, 2)
    fold_all(heartbeat("b", 5 * GiB, t=25), state=state)
    decisions = settle(state, 30)
    assert msg_ids(decisions) == ["timedout:a:2025-01-01T00:00:00+00:00", "placement:i:2"]
    rejected = the(PlacementRejected, decisions)
    assert rejected.reason.startswith(
        "node a is timed out; and it cannot be placed again: m needs 8.00 GiB"
    )
    assert rejected.generation == 2
    assert rejected.available_bytes == {"b:cpu": usable(5 * GiB)}
    assert runner_layout(state, "i") == []
    assert settle(state, 31) == []
    fold_all(heartbeat("a", 20 * GiB, t=40), state=state)
    decisions = settle(state, 41)
    assert msg_ids(decisions) == ["placement:i:3"]
    assert layout(the(InstancePlaced, decisions).shards) == [(0, 0, "a:cpu", 0, 32)]
    assert settle(state, 42) == []


def test_placing_again_keeps_the_healthy_replica_and_its_runner() -> None:
    state = fold_all(
        node("a", 20 * GiB),
        node("b", 15 * GiB),
        node("c", 10 * GiB),
        model(size=8 * GiB),
        request(replicas=2),
    )
    settle(state, 2)
    assert runner_layout(state, "i") == [(0, 0, "a:cpu", 0, 32), (1, 0, "b:cpu", 0, 32)]
    fold_all(
        runner_state("i-g1-r0-s0", "i", "a", "Ready", t=5),
        runner_state("i-g1-r1-s0", "i", "b", "Ready", t=5),
        heartbeat("a", 20 * GiB, t=25),
        heartbeat("c", 10 * GiB, t=25),
        state=state,
    )
    decisions = settle(state, 30)
    assert msg_ids(decisions) == ["timedout:b:2025-01-01T00:00:00+00:00", "placement:i:2"]
    again = the(InstancePlaced, decisions)
    assert again.reason == "node b is timed out"
    assert [(s.runner_id, f"{s.node_id}:{s.device}") for s in again.shards] == [
        ("i-g1-r0-s0", "a:cpu"),
        ("i-g2-r1-s0", "c:cpu"),
    ]
    kept, moved = state.runner("i-g1-r0-s0"), state.runner("i-g2-r1-s0")
    assert kept is not None and kept.state == "Ready"  # still running: not restarted
    assert moved is not None and moved.state == "Assigned"
    assert state.runner("i-g1-r1-s0") is None
    assert settle(state, 31) == []


# --- runners that keep failing ------------------------------------------------------------


def test_a_runner_failing_three_times_within_the_window_moves_the_instance() -> None:
    state = placed_on_a()
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 11, 12], error="out of memory"), state=state)
    decisions = settle(state, 13)
    assert msg_ids(decisions) == ["placement:i:2"]
    again = the(InstancePlaced, decisions)
    assert again.reason == "runner i-g1-r0-s0 failed 3 times within 120 s on a:cpu (out of memory)"
    assert again.avoid == ["a:cpu"]
    assert [(s.runner_id, f"{s.node_id}:{s.device}") for s in again.shards] == [
        ("i-g2-r0-s0", "b:cpu")
    ]
    inst = state.instance("i")
    assert inst is not None and (inst.avoid, inst.generation) == (["a:cpu"], 2)
    assert settle(state, 14) == []


def test_two_failures_do_not_move_the_instance() -> None:
    state = placed_on_a()
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 11]), state=state)
    assert settle(state, 12) == []


def test_a_runner_running_again_after_three_failures_is_left_alone() -> None:
    state = placed_on_a()
    fold_all(
        failures("i-g1-r0-s0", "i", "a", [10, 11, 12]),
        runner_state("i-g1-r0-s0", "i", "a", "Ready", t=13),
        state=state,
    )
    assert settle(state, 14) == []


def _with_heartbeats(state: ClusterState, t: float) -> None:
    fold_all(heartbeat("a", 20 * GiB, t=t), heartbeat("b", 15 * GiB, t=t), state=state)


def test_failures_spread_over_more_than_the_window_do_not_move_the_instance() -> None:
    state = placed_on_a()
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 80, 131]), state=state)
    _with_heartbeats(state, 131)
    assert settle(state, 132) == []


def test_failures_exactly_the_window_apart_move_the_instance() -> None:
    state = placed_on_a()
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 70, 130]), state=state)
    _with_heartbeats(state, 130)
    again = the(InstancePlaced, settle(state, 131))
    assert again.reason.startswith("runner i-g1-r0-s0 failed 3 times within 120 s on a:cpu")


def test_the_failure_limit_and_window_come_from_the_policy() -> None:
    state = placed_on_a()
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 15]), state=state)
    strict = PlannerPolicy(failure_limit=2, failure_window_s=5)
    again = the(InstancePlaced, decide(state, at(16), strict))
    assert again.reason.startswith("runner i-g1-r0-s0 failed 2 times within 5 s on a:cpu")
    assert decide(state, at(16), PlannerPolicy(failure_limit=2, failure_window_s=4.9)) == []


def test_devices_to_avoid_accumulate_as_runners_keep_failing() -> None:
    state = fold_all(
        node("a", 20 * GiB),
        node("b", 15 * GiB),
        node("c", 10 * GiB),
        model(size=8 * GiB),
        request(),
    )
    settle(state, 2)
    fold_all(failures("i-g1-r0-s0", "i", "a", [3, 4, 5]), state=state)
    assert layout(the(InstancePlaced, settle(state, 6)).shards) == [(0, 0, "b:cpu", 0, 32)]
    fold_all(failures("i-g2-r0-s0", "i", "b", [7, 8, 9]), state=state)
    again = the(InstancePlaced, settle(state, 10))
    assert layout(again.shards) == [(0, 0, "c:cpu", 0, 32)]
    assert again.avoid == ["a:cpu", "b:cpu"]
    assert settle(state, 11) == []


def _failing_on_the_only_device() -> tuple[ClusterState, list[Decision]]:
    state = fold_all(node("a", 20 * GiB), model(size=8 * GiB), request())
    settle(state, 2)
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 11, 12]), state=state)
    return state, settle(state, 13)


def test_a_runner_failing_on_the_only_device_rejects_the_instance() -> None:
    state, decisions = _failing_on_the_only_device()
    assert msg_ids(decisions) == ["placement:i:2"]
    rejected = the(PlacementRejected, decisions)
    assert rejected.reason.startswith(
        "runner i-g1-r0-s0 failed 3 times within 120 s on a:cpu (boom);"
        " and it cannot be placed again: m needs 8.00 GiB"
    )
    # The device's own failure is named where it is said not to be used.
    assert rejected.reason.endswith(
        "the only devices online are a:cpu, where its runners kept failing (a:cpu: boom)"
    )
    assert rejected.generation == 2
    inst = state.instance("i")
    assert inst is not None and inst.status == "rejected"
    assert runner_layout(state, "i") == []


def test_after_rejecting_a_failing_instance_later_rounds_decide_nothing() -> None:
    state, _ = _failing_on_the_only_device()
    assert settle(state, 14) == []
    assert settle(state, 15) == []


def test_a_manual_spec_on_a_failing_device_is_rejected_with_the_reason() -> None:
    spec = '{"chat": {"devices": ["a:cpu"]}}'
    state = fold_all(node("a", 20 * GiB), node("b", 20 * GiB), model(size=8 * GiB))
    fold_all(request(spec=spec), state=state)
    assert layout(the(InstancePlaced, settle(state, 2)).shards) == [(0, 0, "a:cpu", 0, 32)]
    fold_all(failures("i-g1-r0-s0", "i", "a", [10, 11, 12]), state=state)
    rejected = the(PlacementRejected, settle(state, 13))
    assert rejected.reason == (
        "runner i-g1-r0-s0 failed 3 times within 120 s on a:cpu (boom); and it cannot be"
        " placed again: runners of this instance kept failing on a:cpu"
    )


# --- whole stories ------------------------------------------------------------------------


def _rounds_until_quiet(state: ClusterState, start: float, limit: int = 5) -> list[list[str]]:
    """Planner rounds one second apart until one decides nothing; the msg ids of each."""
    history: list[list[str]] = []
    for k in range(limit):
        decisions = settle(state, start + k)
        if not decisions:
            return history
        history.append(msg_ids(decisions))
    raise AssertionError(f"still deciding after {limit} rounds: {history}")


def test_a_busy_cluster_settles_in_one_round() -> None:
    events: list[Event | list[Event]] = [
        node("a", 40 * GiB, heartbeat_s=60),
        node("b", 40 * GiB, heartbeat_s=60),
        node("gone", 80 * GiB, heartbeat_s=2),
        model(size=8 * GiB),
        model("split", size=30 * GiB, n_layers=24),
        request("one", t=1),
        request("two", replicas=2, t=2),
        request("three", "split", t=3),
        request("ghost", "nothing", t=4),
    ]
    state = fold_all(*events)
    assert _rounds_until_quiet(state, 10) == [
        [
            "timedout:gone:2025-01-01T00:00:00+00:00",
            "placement:one:1",
            "placement:two:1",
            "placement:three:1",
            "placement:ghost:1",
        ]
    ]
    # 36 GiB each: one on a (28 left), two on b then a (28, 20 left), three split 28:20.
    assert runner_layout(state, "one") == [(0, 0, "a:cpu", 0, 32)]
    assert runner_layout(state, "two") == [(0, 0, "b:cpu", 0, 32), (1, 0, "a:cpu", 0, 32)]
    assert runner_layout(state, "three") == [(0, 0, "b:cpu", 0, 14), (0, 1, "a:cpu", 14, 24)]
    ghost = state.instance("ghost")
    assert ghost is not None and ghost.status == "rejected"
