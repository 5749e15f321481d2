"""``shoal api``'s options, as the API takes them."""

from __future__ import annotations

import pytest
import typer

from cli.api import reasoning_budget


def test_the_reasoning_budget_option() -> None:
    assert reasoning_budget(-1) is None  # unbounded, the default
    assert reasoning_budget(512) == 512
    with pytest.raises(typer.Exit):
        reasoning_budget(0)  # a request turns the thinking off itself
