"""Dividing a model's layers between pipeline stages: largest remainder, at least one each."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.planner.layers import split_layers


@pytest.mark.parametrize(
    ("n_layers", "weights", "expected"),
    [
        (1, [5.0], [1]),
        (32, [1.0], [32]),
        (24, [3.0, 1.0], [18, 6]),
        (10, [1.0, 1.0], [5, 5]),
        (24, [18.0, 9.0], [16, 8]),
        (24, [9.0, 9.0, 9.0], [8, 8, 8]),
        # Largest remainders get the leftover layers: quotas 3.33, 3.33, 3.33 -> one left over.
        (10, [1.0, 1.0, 1.0], [4, 3, 3]),
        # Quotas 4.2, 2.8: the larger remainder (0.8) takes the layer left over.
        (7, [3.0, 2.0], [4, 3]),
        # Quotas 1.5, 2.5, 3.0: remainders tie at 0.5, the earlier stage gets the layer.
        (7, [3.0, 5.0, 6.0], [2, 2, 3]),
        # Every stage gets one layer, however small its weight.
        (5, [100.0, 1.0], [4, 1]),
        (4, [1000.0, 1.0, 1.0], [2, 1, 1]),
        (3, [1.0, 1e-9, 1e-9], [1, 1, 1]),
        # Bytes of room, as placement passes them.
        (32, [float(30 * 2**30), float(10 * 2**30)], [24, 8]),
    ],
)
def test_split_layers_examples(n_layers: int, weights: list[float], expected: list[int]) -> None:
    assert split_layers(n_layers, weights) == expected


def test_equal_weights_leftover_goes_to_the_earlier_stages() -> None:
    assert split_layers(7, [1.0, 1.0]) == [4, 3]
    assert split_layers(11, [2.0, 2.0, 2.0]) == [4, 4, 3]


@pytest.mark.parametrize(
    ("n_layers", "weights", "message"),
    [
        (2, [1.0, 1.0, 1.0], "cannot split 2 layers into 3 stages"),
        (4, [], "cannot split 4 layers into 0 stages"),
        (0, [1.0], "cannot split 0 layers into 1 stages"),
        (4, [1.0, 0.0], "weights must be positive, got [1.0, 0.0]"),
        (4, [1.0, -2.0], "weights must be positive"),
        (4, [math.nan, 1.0], "weights must be positive"),
    ],
)
def test_split_layers_refuses_impossible_splits(
    n_layers: int, weights: list[float], message: str
) -> None:
    with pytest.raises(ValueError) as exc:
        split_layers(n_layers, weights)
    assert message in str(exc.value)


def test_a_stage_raised_to_one_layer_gets_no_leftover_before_stages_below_quota() -> None:
    # Quotas 0.9, 1.5, 1.6: the first stage is raised to 1 (above its quota already); the one
    # layer left over belongs to the stage furthest below quota, the last.
    assert split_layers(4, [9.0, 15.0, 16.0]) == [1, 1, 2]


def test_equal_weights_keep_the_earlier_stage_ahead_when_minimums_overshoot() -> None:
    # Quotas 0.07 x 4 and 3.37 x 2: four stages raised to 1 overshoot by 3; the two equal
    # stages should end 2 and 1, the earlier ahead, as everywhere else.
    assert split_layers(7, [1.0, 1.0, 1.0, 1.0, 50.0, 50.0]) == [1, 1, 1, 1, 2, 1]


# --- properties ---------------------------------------------------------------------------

weights_st = st.lists(
    st.floats(min_value=1e-3, max_value=1e12, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=12,
)


@st.composite
def splits(draw: st.DrawFn) -> tuple[int, list[float]]:
    weights = draw(weights_st)
    n_layers = draw(st.integers(min_value=len(weights), max_value=200))
    return n_layers, weights


@settings(database=None)
@given(splits())
def test_split_layers_sums_to_n_layers_with_at_least_one_each(
    case: tuple[int, list[float]],
) -> None:
    n_layers, weights = case
    counts = split_layers(n_layers, weights)
    assert len(counts) == len(weights)
    assert sum(counts) == n_layers
    assert min(counts) >= 1
    assert split_layers(n_layers, list(weights)) == counts  # deterministic


@settings(database=None)
@given(splits())
def test_split_layers_rounds_each_quota_down_or_up_when_all_quotas_reach_one(
    case: tuple[int, list[float]],
) -> None:
    n_layers, weights = case
    quotas = [n_layers * w / math.fsum(weights) for w in weights]
    counts = split_layers(n_layers, weights)
    if min(quotas) >= 1:
        for count, quota in zip(counts, quotas, strict=True):
            assert math.floor(quota) <= count <= math.ceil(quota)


@settings(database=None)
@given(splits())
@example((4, [9.0, 15.0, 16.0]))
def test_a_larger_weight_never_gets_fewer_layers(case: tuple[int, list[float]]) -> None:
    n_layers, weights = case
    counts = split_layers(n_layers, weights)
    for i, wi in enumerate(weights):
        for j, wj in enumerate(weights):
            if wi > wj:
                assert counts[i] >= counts[j], (weights, counts)
