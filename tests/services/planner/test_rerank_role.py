"""The rerank role from the request to placement, as the embed role's (``test_embed_role.py``):
a small context, the spec's ``{"rerank": ...}`` entry, one slot, llama.cpp only."""

from __future__ import annotations

import pytest

from events.units import GiB
from services.models.footprint import DEFAULT_EMBED_CONTEXT_LENGTH, context_for
from services.planner.instance_request import RequestRefused, placement_request
from services.planner.placement_spec import instance_role
from tests.services.planner.builders import fold_all, model


def test_a_rerank_instance_has_a_small_context_and_its_own_spec_entry() -> None:
    assert context_for(8192, None, "rerank") == DEFAULT_EMBED_CONTEXT_LENGTH
    assert context_for(256, None, "rerank") == 256  # never more than the model's own
    assert instance_role('{"rerank": {"devices": ["n:cpu"]}}') == "rerank"
    assert instance_role(None, "rerank") == "rerank"


def test_a_rerank_instance_serves_one_task_at_a_time_on_llama_cpp() -> None:
    state = fold_all(model("r", size=GiB), model("x", size=GiB, engine="mlx"))
    asked = placement_request(state, instance_id="i", model_id="r", role="rerank")
    assert asked.role == "rerank"
    with pytest.raises(RequestRefused, match="a rerank instance serves one task at a time"):
        placement_request(state, instance_id="i", model_id="r", role="rerank", slots=2)
    with pytest.raises(RequestRefused, match="mlx engine: reranking is not supported"):
        placement_request(state, instance_id="i", model_id="x", role="rerank")
