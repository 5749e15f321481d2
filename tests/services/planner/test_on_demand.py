"""Instances loaded on demand (services/planner/on_demand.py): unloaded when idle past their
keep-alive, never when pinned or busy, and unloaded least recently used first to make room for
another (memory, or a node's limit on loaded instances)."""

from __future__ import annotations

from typing import Any

import pytest

from events.catalogue import (
    EmbeddingsRequested,
    InstanceDeleted,
    InstancePlaced,
    InstanceRequested,
    PlacementRejected,
    TaskCompleted,
    TaskCreated,
)
from events.records import ChatMessage, Timings, Usage
from events.units import GiB
from projectors.rules import fold
from projectors.state import ClusterState
from services.planner.decisions import Decision, PlannerPolicy, decide
from services.planner.on_demand import Busy, busy_roles, expires_at, parse_keep_alive
from tests.services.planner.builders import at, fold_all, model
from tests.services.planner.builders import node as make_node

POLICY = PlannerPolicy()


def node(node_id: str, offered: int) -> list[Any]:
    """A node whose heartbeats are a day apart: none times out in these tests."""
    return make_node(node_id, offered, heartbeat_s=86_400)


def on_demand(instance_id: str, model_id: str, t: float, keep: float | None = None) -> Any:
    return InstanceRequested(
        instance_id=instance_id,
        model_id=model_id,
        origin="api",
        ts=at(t),
        on_demand=True,
        keep_alive_s=keep,
        reason="loaded on demand: a chat request",
    )


def used(model_id: str, task_id: str, t: float, keep: float | None = None) -> list[Any]:
    """A task of ``model_id`` made at ``t`` and ended a second later."""
    return [
        TaskCreated(
            task_id=task_id,
            model_id=model_id,
            origin="api",
            ts=at(t),
            messages=[ChatMessage(role="user", content="hi")],
            keep_alive_s=keep,
        ),
        TaskCompleted(
            task_id=task_id,
            model_id=model_id,
            origin="r",
            ts=at(t + 1),
            runner_id="r",
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=1),
            timings=Timings(ttft_ms=1, tokens_per_s=1, total_ms=1),
        ),
    ]


def round_at(
    state: ClusterState, t: float, busy: Busy | None = None, policy: PlannerPolicy = POLICY
) -> list[Decision]:
    decisions = decide(state, at(t), policy, busy=busy)
    fold([d.event for d in decisions], state)
    return decisions


def kinds(decisions: list[Decision]) -> list[tuple[str, str]]:
    return [(type(d.event).__name__, d.msg_id.split(":")[0]) for d in decisions]


def deleted(decisions: list[Decision]) -> dict[str, str]:
    return {
        d.event.instance_id: d.event.reason
        for d in decisions
        if isinstance(d.event, InstanceDeleted)
    }


def test_an_idle_instance_is_unloaded_after_its_keep_alive_and_not_before() -> None:
    state = fold_all(node("a", 20 * GiB), model("m", size=2 * GiB), on_demand("od", "m", 1))
    assert kinds(round_at(state, 2)) == [("InstancePlaced", "placement")]
    fold_all(*used("m", "t1", 100), state=state)  # ends at 101
    row = state.instance("od")
    assert row is not None and row.last_used_at == at(101)
    assert expires_at(row, POLICY.default_keep_alive_s) == at(401)
    assert round_at(state, 400) == []
    assert round_at(state, 402, busy={("m", "chat"): 1}) == []  # a task under way: kept
    decisions = round_at(state, 402)
    assert deleted(decisions) == {"od": "unloaded: idle for 300 s (its keep-alive)"}
    assert decisions[0].msg_id == f"idle:od:{at(101).isoformat()}"
    assert round_at(state, 500) == []  # once


def test_a_pinned_instance_is_never_unloaded() -> None:
    pinned = InstanceRequested(instance_id="p", model_id="m", origin="cli", ts=at(1))
    state = fold_all(node("a", 20 * GiB), model("m", size=2 * GiB), pinned)
    round_at(state, 2)
    fold_all(*used("m", "t1", 10, keep=0), state=state)  # a request's keep_alive: not for it
    row = state.instance("p")
    assert row is not None and row.keep_alive_s is None and expires_at(row, 300) is None
    assert round_at(state, 100_000) == []


def test_a_request_s_keep_alive_sets_the_instance_s() -> None:
    state = fold_all(node("a", 20 * GiB), model("m", size=2 * GiB), on_demand("od", "m", 1))
    round_at(state, 2)
    fold_all(*used("m", "t1", 10, keep=-1), state=state)  # kept for ever
    assert round_at(state, 100_000) == []
    fold_all(*used("m", "t2", 100_010, keep=0), state=state)  # unloaded once it ends
    assert list(deleted(round_at(state, 100_011))) == ["od"]


def test_room_is_made_by_unloading_the_least_recently_used_idle_instances() -> None:
    state = fold_all(
        node("a", 20 * GiB),  # 18 GiB usable: two 8 GiB models, not three
        model("x", size=8 * GiB),
        model("y", size=8 * GiB),
        model("z", size=8 * GiB),
        on_demand("ox", "x", 1),
        on_demand("oy", "y", 1),
    )
    round_at(state, 2)
    fold_all(*used("y", "ty", 10), *used("x", "tx", 20), state=state)  # y used least lately
    fold_all(on_demand("oz", "z", 30), state=state)
    decisions = round_at(state, 31)
    assert kinds(decisions) == [("InstanceDeleted", "room"), ("InstancePlaced", "placement")]
    assert deleted(decisions) == {"oy": "unloaded to make room for z (oz)"}
    placed = [d.event for d in decisions if isinstance(d.event, InstancePlaced)]
    assert placed[0].instance_id == "oz"


def test_a_busy_or_pinned_instance_is_never_unloaded_for_another() -> None:
    pinned = InstanceRequested(instance_id="px", model_id="x", origin="cli", ts=at(1))
    state = fold_all(
        node("a", 20 * GiB),
        model("x", size=8 * GiB),
        model("y", size=8 * GiB),
        model("z", size=8 * GiB),
        pinned,
        on_demand("oy", "y", 1),
    )
    round_at(state, 2)
    fold_all(on_demand("oz", "z", 30), state=state)
    decisions = round_at(state, 31, busy={("y", "chat"): 2})
    assert [type(d.event) for d in decisions] == [PlacementRejected]
    assert deleted(decisions) == {}


def test_a_node_holds_at_most_max_loaded_instances() -> None:
    policy = PlannerPolicy(max_loaded=1)
    state = fold_all(
        node("a", 100 * GiB), model("x", size=GiB), model("y", size=GiB), on_demand("ox", "x", 1)
    )
    round_at(state, 2, policy=policy)
    fold_all(on_demand("oy", "y", 10), state=state)
    decisions = round_at(state, 11, policy=policy)
    assert deleted(decisions) == {"ox": "unloaded to make room for y (oy)"}
    assert kinds(decisions)[-1] == ("InstancePlaced", "placement")
    # A pinned instance is not unloaded for the limit: the next waits for room.
    fold_all(
        InstanceRequested(instance_id="pz", model_id="x", origin="cli", ts=at(20)), state=state
    )
    state = fold_all(
        node("a", 100 * GiB),
        model("x", size=GiB),
        model("y", size=GiB),
        InstanceRequested(instance_id="px", model_id="x", origin="cli", ts=at(1)),
    )
    round_at(state, 2, policy=policy)
    fold_all(on_demand("oy", "y", 10), state=state)
    decisions = round_at(state, 11, policy=policy)
    assert [type(d.event) for d in decisions] == [PlacementRejected]


def test_two_planners_on_the_same_state_decide_the_same() -> None:
    state = fold_all(
        node("a", 20 * GiB),
        model("x", size=8 * GiB),
        model("y", size=8 * GiB),
        model("z", size=8 * GiB),
        on_demand("ox", "x", 1),
        on_demand("oy", "y", 1),
    )
    round_at(state, 2)
    fold_all(on_demand("oz", "z", 30), state=state)
    first, second = decide(state, at(31), POLICY), decide(state, at(31), POLICY)
    assert [d.msg_id for d in first] == [d.msg_id for d in second]
    assert first[0].msg_id == "room:ox:oz:1"  # as recently used: the instance id decides


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(300, 300.0), ("300", 300.0), ("5m", 300.0), ("1.5h", 5400.0), ("90s", 90.0), (-1, -1.0)],
)
def test_keep_alive_durations(given: float | str, seconds: float) -> None:
    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "", "nan", True])
def test_bad_keep_alive_durations(given: Any) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(given)


def test_a_rerank_task_keeps_its_rerank_instance_in_use() -> None:
    """A rerank task (``EmbeddingsRequested`` with a query) is the rerank instance's, as an
    embeddings task is the embed instance's: its keep-alive, its last use, and busy."""
    reranker = on_demand("od", "m", 1).model_copy(update={"role": "rerank"})
    state = fold_all(node("a", 20 * GiB), model("m", size=2 * GiB), reranker)
    round_at(state, 2)
    asked = EmbeddingsRequested(
        task_id="t1", model_id="m", origin="api", ts=at(100), query="q", texts=["d"]
    ).model_copy(update={"keep_alive_s": 60.0})
    ended = used("m", "t1", 100)[1]
    fold_all(asked, ended, state=state)
    row, task = state.instance("od"), state.task("t1")
    assert task is not None and task.kind == "rerank"
    assert row is not None and (row.keep_alive_s, row.last_used_at) == (60, at(101))
    assert busy_roles({("m", "rerank"): 1, ("m", "embedding"): 2, ("m", "chat"): 3}) == {
        ("m", "rerank"): 1,
        ("m", "embed"): 2,
        ("m", "chat"): 3,
    }
    assert round_at(state, 200, busy={("m", "rerank"): 1}) == []  # a task under way: kept
    assert deleted(round_at(state, 200)) == {"od": "unloaded: idle for 60 s (its keep-alive)"}
