"""`shoal state`'s tables: states coloured by meaning, a shard's layers as a range."""

from __future__ import annotations

from cli.state import _styled


def test_statuses_are_coloured_by_what_they_mean() -> None:
    assert _styled("status", {"status": "online"}).style == "green"
    assert _styled("status", {"status": "timed_out"}).style == "red"
    assert _styled("state", {"state": "Loading"}).style == "yellow"
    assert _styled("state", {"state": "Stopped"}).style == "dim"
    assert _styled("hostname", {"hostname": "online"}).style == ""  # only status columns


def test_a_shard_shows_its_layers_inclusive() -> None:
    assert _styled("layers", {"start_layer": 15, "end_layer": 30}).plain == "15-29"
    assert _styled("layers", {"start_layer": 0, "end_layer": 0}).plain == "-"
