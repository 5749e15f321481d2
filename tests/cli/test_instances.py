"""`shoal instances list`'s reading of a runner's state."""

from __future__ import annotations

import pytest

from cli.instances import parse_speculative, shard_state
from events.records import Speculative


def test_a_runner_on_its_way_shows_how_far_it_got() -> None:
    assert shard_state("Downloading", 0.424) == "Downloading 42%"
    assert shard_state("Loading", 1.0) == "Loading 100%"


def test_other_states_show_as_they_are() -> None:
    assert shard_state("Loading", None) == "Loading"
    assert shard_state("Ready", 1.0) == "Ready"  # a progress left from the load is not shown
    assert shard_state("Failed", 0.3) == "Failed"


def test_speculative_is_read_as_the_api_takes_it() -> None:
    assert parse_speculative("ngram") == Speculative(type="ngram")
    assert parse_speculative("ngram:8") == Speculative(type="ngram", draft_max=8)
    asked = parse_speculative('{"type": "ngram", "ngram_min": 3, "ngram_max": 5}')
    assert (asked.ngram_min, asked.ngram_max) == (3, 5)
    with pytest.raises(ValueError, match="'draft' is not a kind of speculative decoding"):
        parse_speculative("draft")
    with pytest.raises(ValueError, match="less than or equal to 64"):
        parse_speculative("ngram:100")
