"""The suite's own scheduling (tests/conftest.py) names modules that exist."""

from __future__ import annotations

from tests.conftest import LONGEST, TESTS, shared_fixture


def test_the_longest_modules_exist() -> None:
    assert [m for m in LONGEST if not (TESTS.parent / m).is_file()] == []


def test_a_module_naming_a_shared_fixture_is_grouped_by_it() -> None:
    assert shared_fixture("tests/api/test_clients.py") == "up_cluster"
    assert shared_fixture("tests/api/test_thinking_clients.py") == "up_cluster"
    assert shared_fixture("tests/events/test_catalogue.py") is None
