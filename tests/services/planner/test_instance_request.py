"""What an instance request may ask for its runners, checked before placement
(``services/planner/instance_request.py``)."""

from __future__ import annotations

import pytest

from events.records import Speculative
from events.units import GiB
from services.planner.instance_request import RequestRefused, placement_request
from tests.services.planner.builders import fold_all, model, node


def test_speculative_decoding_is_for_the_llamacpp_engines_chat_instances() -> None:
    state = fold_all(node("a", 8 * GiB), model("g", size=GiB), model("x", size=GiB, engine="mlx"))
    drafts = Speculative(type="ngram")
    assert placement_request(state, instance_id="i", model_id="g", speculative=drafts)
    with pytest.raises(RequestRefused, match="the mlx engine does not decode speculatively"):
        placement_request(state, instance_id="i", model_id="x", speculative=drafts)
    with pytest.raises(RequestRefused, match="an embed instance generates no tokens") as refused:
        placement_request(state, instance_id="i", model_id="g", role="embed", speculative=drafts)
    assert refused.value.field == "speculative"
