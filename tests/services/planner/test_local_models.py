"""A model kept at a path on one node (``shoal models add --local``) is placed on that node or
not at all; a shared model (in the models bucket) anywhere."""

from __future__ import annotations

import json

from events.catalogue import InstancePlaced, ModelAdded, PlacementRejected
from events.units import GiB
from services.planner.cluster import cluster_view
from services.planner.decisions import PlannerPolicy, decide
from services.planner.placement import ModelInfo, PlacementRequest, place
from tests.services.planner.builders import (
    at,
    fold_all,
    layout,
    model,
    node,
    placement,
    rejection,
    request,
)


def _local(node_id: str, size: int = 2 * GiB) -> ModelAdded:
    return model(size=size).model_copy(update={"node_id": node_id, "path": "/models/m.gguf"})


def test_a_local_model_goes_to_its_node_even_when_another_is_roomier() -> None:
    state = fold_all(node("a", 10 * GiB), node("b", 40 * GiB), _local("a"))
    row = state.model("m")
    assert row is not None and row.node_id == "a"
    result = placement(place(cluster_view(state), PlacementRequest("i", ModelInfo.of(row))))
    assert layout(result.shards) == [(0, 0, "a:cpu", 0, 32)]


def test_a_local_model_is_not_split_onto_other_nodes() -> None:
    state = fold_all(node("a", 4 * GiB), node("b", 40 * GiB), _local("a", size=8 * GiB))
    row = state.model("m")
    assert row is not None
    result = rejection(place(cluster_view(state), PlacementRequest("i", ModelInfo.of(row))))
    assert "a:cpu" in result.reason and "b:cpu" not in result.reason


def test_a_spec_naming_another_node_says_where_the_model_is() -> None:
    state = fold_all(node("a", 10 * GiB), node("b", 10 * GiB), _local("a"))
    row = state.model("m")
    assert row is not None
    spec = json.dumps({"chat": {"devices": ["a:cpu", "b:cpu"]}})
    result = rejection(
        place(cluster_view(state), PlacementRequest("i", ModelInfo.of(row), spec=spec))
    )
    assert result.reason == "m is kept on node a only (added with --local), not on b"


def test_a_local_model_whose_node_is_gone_is_rejected_with_why() -> None:
    state = fold_all(node("b", 10 * GiB), _local("a"))
    row = state.model("m")
    assert row is not None
    result = rejection(place(cluster_view(state), PlacementRequest("i", ModelInfo.of(row))))
    assert result.reason == "m is kept on node a only (added with --local), which is not online"


def test_the_planner_places_a_local_model_on_its_node_and_a_shared_one_anywhere() -> None:
    shared = model("s", size=2 * GiB).model_copy(update={"files": []})
    state = fold_all(
        node("a", 10 * GiB),
        node("b", 40 * GiB),
        _local("a"),
        shared,
        request("i", "m"),
        request("j", "s"),
    )
    decisions = decide(state, at(2), PlannerPolicy())
    placed = {
        d.event.instance_id: d.event for d in decisions if isinstance(d.event, InstancePlaced)
    }
    assert not [d for d in decisions if isinstance(d.event, PlacementRejected)]
    assert [s.node_id for s in placed["i"].shards] == ["a"]
    assert [s.node_id for s in placed["j"].shards] == ["b"]
