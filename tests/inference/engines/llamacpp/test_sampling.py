"""The llama.cpp engine's sampling parts that need no model (the rest is test_llamacpp.py)."""

from __future__ import annotations

import numpy as np
import pytest

from events.records import SamplingParams
from inference.decoding import LOGPROB_FLOOR
from inference.engines.llamacpp.sampling import TOKEN_DATA, Candidates, scored, seed_of
from inference.generation import check_against_vocabulary
from structured.reply import InvalidRequest, Trigger


def test_scores_are_the_log_softmax_with_the_most_likely_first() -> None:
    logits = np.array([1.0, 3.0, 2.0, 3.0, -1.0], dtype=np.float32)
    expected = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    token = scored(logits, 2, 3)
    assert token.id == 2 and token.logprob == pytest.approx(expected[2])
    # Ties in the order of their ids.
    assert [i for i, _ in token.top] == [1, 3, 2]
    assert [lp for _, lp in token.top] == pytest.approx(expected[[1, 3, 2]])
    assert scored(logits, 0, 0).top == ()
    every = scored(logits, 0, len(logits))
    assert np.exp([lp for _, lp in every.top]).sum() == pytest.approx(1.0)


def test_scores_never_go_below_the_floor() -> None:
    logits = np.array([0.0, -np.inf, -1e6], dtype=np.float32)
    token = scored(logits, 1, 3)
    assert token.logprob == LOGPROB_FLOOR
    assert [lp for _, lp in token.top] == [0.0, LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_seeds_fold_below_llamas_random_seed() -> None:
    """llama.cpp draws a random seed for 0xFFFFFFFF: no request's seed becomes it."""
    assert seed_of(SamplingParams(seed=7)) == 7
    assert seed_of(SamplingParams(seed=0xFFFFFFFF)) == 0
    assert seed_of(SamplingParams(seed=-1)) == 0xFFFFFFFE
    assert all(0 <= seed_of(SamplingParams()) < 0xFFFFFFFF for _ in range(20))


def test_params_the_samplers_cannot_take() -> None:
    check_against_vocabulary(SamplingParams(logit_bias={0: 1.0, 9: -1.0}), 10, 20)
    with pytest.raises(InvalidRequest, match="logit_bias names token 10, outside"):
        check_against_vocabulary(SamplingParams(logit_bias={10: 1.0}), 10, None)
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        check_against_vocabulary(SamplingParams(), 10, -1)


def test_triggers_match_as_llama_cpps_do() -> None:
    # Anywhere; the grammar takes the text from the match...
    assert Trigger("<tool_call>").start(b"Sure. <tool_call> {") == 6
    assert Trigger("<tool_call>").start(b"Sure. <tool_") is None
    # ... or from the first capture group that matched something.
    assert Trigger(r"[\s\S]*?(<a>|<b>)[\s\S]*").start(b"xx<b>yy") == 2
    # ^...$: the whole text.
    assert Trigger(r"^\s*(\{)[\s\S]*$").start(b'  {"a"') == 2
    assert Trigger(r"^\s*(\{)[\s\S]*$").start(b'x  {"a"') is None
    # "$" is the end of the text, not before a last newline (std::regex, not Python's re).
    assert Trigger(r"^\{$").start(b"{\n") is None


def test_candidates_back_a_token_data_array_with_numpy() -> None:
    candidates = Candidates(4)
    candidates.load(np.array([0.5, 1.5, -2.0, 3.0], dtype=np.float32), banned=[3])
    array = candidates.array
    assert array.size == 4 and array.selected == -1 and not array.sorted
    assert [(int(array.data[i].id), array.data[i].logit) for i in range(4)] == [
        (0, 0.5),
        (1, 1.5),
        (2, -2.0),
        (3, -np.inf),
    ]
    array.selected = 1
    assert candidates.selected() == (1, 1.5)
    assert TOKEN_DATA.names == ("id", "logit", "p")
