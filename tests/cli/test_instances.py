"""`shoal instances list`'s reading of a runner's state."""

from __future__ import annotations

from cli.instances import shard_state


def test_a_runner_on_its_way_shows_how_far_it_got() -> None:
    assert shard_state("Downloading", 0.424) == "Downloading 42%"
    assert shard_state("Loading", 1.0) == "Loading 100%"


def test_other_states_show_as_they_are() -> None:
    assert shard_state("Loading", None) == "Loading"
    assert shard_state("Ready", 1.0) == "Ready"  # a progress left from the load is not shown
    assert shard_state("Failed", 0.3) == "Failed"
