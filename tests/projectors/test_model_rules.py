"""The rules of a model's removal and of a node's eviction, as a pure function."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from events.catalogue import ModelAdded, ModelEvicted, ModelRemoved
from projectors.rows import ModelRow
from projectors.rules import changes_for, fold
from projectors.state import ClusterState, Delete

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def added(model_id: str, ts: float, n_layers: int = 10) -> ModelAdded:
    return ModelAdded(model_id=model_id, origin="c", ts=at(ts), n_layers=n_layers, size_bytes=1)


def test_a_removed_model_leaves_the_projection_and_can_be_added_again() -> None:
    removed = ModelRemoved(model_id="m", origin="c", ts=at(1))
    state = fold([added("m", 0), added("other", 0), removed])
    assert state.model("m") is None and state.model("other") is not None
    assert changes_for(fold([added("m", 0)]), removed) == [Delete(ModelRow.TABLE, ("m",))]
    again = fold([added("m", 2, n_layers=12)], state).model("m")
    assert again is not None and again.n_layers == 12 and again.added_at == at(2)


def test_removing_an_unknown_model_changes_nothing() -> None:
    assert changes_for(ClusterState(), ModelRemoved(model_id="m", origin="c")) == []


def test_an_eviction_is_projection_free() -> None:
    evicted = ModelEvicted(node_id="n", model_id="m", origin="n", bytes_freed=10, budget_bytes=100)
    assert changes_for(fold([added("m", 0)]), evicted) == []
    assert evicted.subject == "shoal.events.node.n.m.ModelEvicted"
    assert ModelRemoved(model_id="m", origin="c").subject == "shoal.events.model.m.ModelRemoved"
