"""The weights cache's budget, as pure functions: its parsing, and what to evict."""

from __future__ import annotations

import pytest

from services.models.cache_budget import (
    DEFAULT_CACHE_SIZE,
    CachedModel,
    CacheSize,
    Eviction,
    choose_evictions,
    parse_cache_size,
)


def test_cache_sizes_parse_as_bytes_a_share_of_the_disk_or_no_limit() -> None:
    assert parse_cache_size("50%") == CacheSize(fraction=0.5) == DEFAULT_CACHE_SIZE
    assert parse_cache_size("200G") == CacheSize(bytes=200 * 1024**3)
    assert parse_cache_size("1000") == CacheSize(bytes=1000)
    assert parse_cache_size("-1") == CacheSize()
    assert CacheSize(fraction=0.25).budget(1000) == 250
    assert CacheSize(bytes=7).budget(1000) == 7
    assert CacheSize().budget(1000) is None
    for bad in ("0%", "150%", "half%", "lots"):
        with pytest.raises(ValueError):
            parse_cache_size(bad)


def model(name: str, blobs: str, last_used: float, in_use: bool = False) -> CachedModel:
    return CachedModel(name, frozenset(blobs), last_used, in_use)


# Blobs by one-letter names; "l" is a link to a user's file (it costs nothing).
COSTS = {"a": 10, "b": 20, "c": 30, "d": 40, "l": 0}


def test_nothing_is_evicted_while_the_fetch_fits() -> None:
    models = [model("old", "a", 1), model("new", "b", 2)]
    assert choose_evictions(models, COSTS, budget=200, needed=100) == Eviction()


def test_the_least_recently_used_models_go_until_the_fetch_fits() -> None:
    models = [model("new", "c", 3), model("old", "a", 1), model("mid", "b", 2)]
    costs = {"a": 10, "b": 20, "c": 30}
    # 60 held + 5 needed is 5 over a budget of 60: the oldest model is enough.
    got = choose_evictions(models, costs, budget=60, needed=5)
    assert got.models == (("old", 10),) and got.blobs == frozenset("a") and got.over_by == 0
    got = choose_evictions(models, costs, budget=60, needed=25)
    assert got.models == (("old", 10), ("mid", 20))
    assert got.blobs == frozenset("ab") and got.freed == 30 and got.over_by == 0


def test_models_in_use_and_kept_blobs_stay_and_shared_blobs_go_with_their_last_model() -> None:
    models = [
        model("used", "c", 0, in_use=True),  # oldest, but a runner of the node uses it
        model("x", "ab", 1),
        model("y", "b", 2),  # shares b with x
        model("z", "d", 3),
    ]
    got = choose_evictions(models, COSTS, budget=100, needed=10, keep=frozenset("d"))
    # Held 100 + 10 needed: 10 over. x goes first but frees only a (b is y's too): enough.
    assert got.models == (("x", 10),) and got.blobs == frozenset("a") and got.over_by == 0
    got = choose_evictions(models, COSTS, budget=100, needed=30, keep=frozenset("d"))
    assert got.models == (("x", 10), ("y", 20)) and got.blobs == frozenset("ab")
    # z's only blob is kept (a runner needs it): evicting it would free nothing.
    got = choose_evictions(models, COSTS, budget=100, needed=70, keep=frozenset("d"))
    assert [name for name, _ in got.models] == ["x", "y"] and got.over_by == 40


def test_links_cost_nothing_and_are_never_deleted() -> None:
    models = [model("mine", "l", 0), model("copy", "a", 1)]
    got = choose_evictions(models, {"a": 10, "l": 0}, budget=5, needed=0)
    assert got.models == (("copy", 10),) and got.blobs == frozenset("a")
    # A model of links only frees nothing: left alone even far over the budget.
    got = choose_evictions([model("mine", "l", 0)], {"l": 0, "a": 10}, budget=0, needed=50)
    assert got.models == () and "l" not in got.blobs


def test_copies_no_model_links_go_first() -> None:
    models = [model("old", "a", 1)]
    got = choose_evictions(models, {"a": 10, "b": 20, "c": 5}, budget=20, needed=0)
    assert got.models == () and got.blobs == frozenset("bc") and got.orphan_bytes == 25
    # ... unless a runner needs one (fetched, not linked yet).
    got = choose_evictions(models, {"a": 10, "b": 20}, budget=20, needed=0, keep=frozenset("b"))
    assert got.blobs == frozenset("a") and got.models == (("old", 10),)


def test_ties_in_last_use_go_by_name() -> None:
    models = [model("b", "b", 1), model("a", "a", 1)]
    got = choose_evictions(models, {"a": 10, "b": 20}, budget=25, needed=0)
    assert got.models == (("a", 10),)
