"""Log-probabilities on every engine: a generated token's are the model's own distribution
(before biases, penalties, the grammar and the temperature), computed apart from the engine;
a prompt's scores are too, across prefill chunks; none are computed unless asked."""

from __future__ import annotations

from itertools import islice
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from inference.decoding import LOGPROB_FLOOR, PromptScores, Token
from inference.engines.base import Engine
from inference.engines.mlx.engine import PREFILL_STEP
from inference.generation import ScoredPrompt, Step
from tests.inference.engines.contract.conftest import Reference
from tests.inference.engines.contract.running import decoding, run_steps, tokens, word

# How far an engine's log-probabilities are from the reference's: llama.cpp's reference runs
# as the engine does; MLX's runs the sequence in one pass, the engine token by token.
TOLERANCE = {"llamacpp": 1e-4, "mlx": 2e-3}


def assert_scores(token: Token, row: npt.NDArray[np.float64], k: int, tolerance: float) -> None:
    """A token's reported scores are ``row``'s (the raw log-softmax there)."""
    assert token.logprob == pytest.approx(row[token.id], abs=tolerance)
    assert len(token.top) == k
    assert [lp for _, lp in token.top] == pytest.approx(np.sort(row)[::-1][:k], abs=tolerance)
    for alternative, lp in token.top:
        assert lp == pytest.approx(row[alternative], abs=tolerance)
        assert lp >= LOGPROB_FLOOR


def test_generated_tokens_carry_the_raw_log_probabilities(
    engine: Engine, engine_kind: str, reference: Reference
) -> None:
    prompt = engine.text_tokens("Once upon a time")
    # Penalties, bias and temperature change the choice, not the reported numbers.
    params: dict[str, Any] = {
        "temperature": 1.5,
        "seed": 4,
        "presence_penalty": 1.0,
        "repeat_penalty": 1.3,
        "logit_bias": {word(engine, ","): 3.0, 10: 5.0},
        "top_k": 50,
    }
    out = tokens(engine, prompt, 12, decoding(None, 5, **params))
    assert [t.id for t in out] == [t.id for t in tokens(engine, prompt, 12, decoding(**params))]
    want = reference(prompt, [t.id for t in out])
    for i, token in enumerate(out):
        row = want[len(prompt) - 1 + i]
        assert_scores(token, row, 5, TOLERANCE[engine_kind])
        assert [t for t, _ in token.top] == list(np.argsort(-row, kind="stable")[:5])


def test_no_logprobs_unless_asked_and_greedy_is_the_same(engine: Engine) -> None:
    prompt = engine.text_tokens("Once upon a time")
    plain = tokens(engine, prompt, 20, decoding(temperature=0))
    assert all(t.logprob is None and t.top == () for t in plain)
    scored = tokens(engine, prompt, 20, decoding(None, 0, temperature=0))
    assert [t.id for t in scored] == [t.id for t in plain]
    assert all(t.logprob is not None and t.top == () for t in scored)
    # The greedy token is the most likely one.
    top1 = tokens(engine, prompt, 20, decoding(None, 1, temperature=0))
    assert [t.id for t in top1] == [t.id for t in plain]
    assert all(t.top == ((t.id, t.logprob),) for t in top1)


def test_echo_scores_every_prompt_token_across_chunks(
    engine: Engine, engine_kind: str, reference: Reference
) -> None:
    prompt = engine.text_tokens("the sea is blue, hello world. " * 100)[: PREFILL_STEP + 30]
    assert len(prompt) == PREFILL_STEP + 30  # MLX's prefill chunks, llama.cpp's ECHO_CHUNKs
    items = list(islice(engine.generate(prompt, decoding(None, 3, True, temperature=0)), 3))
    scores = items[0]
    assert isinstance(scores, PromptScores) and all(isinstance(t, Token) for t in items[1:])
    assert [t.id for t in scores.tokens] == prompt
    assert scores.tokens[0] == Token(prompt[0], None, ())
    want = reference(prompt, ())
    for i, token in enumerate(scores.tokens[1:], 1):
        assert_scores(token, want[i - 1], 3, TOLERANCE[engine_kind])
    for i in (1, 63, 64, 65, PREFILL_STEP - 1, PREFILL_STEP, PREFILL_STEP + 1, len(prompt) - 1):
        top = scores.tokens[i].top
        assert [t for t, _ in top] == list(np.argsort(-want[i - 1], kind="stable")[:3])
    # Then the generation goes on, from the prompt's last position, as without echo.
    first = items[1]
    assert isinstance(first, Token)
    assert first.id == int(want[-1].argmax())
    assert_scores(first, want[-1], 3, TOLERANCE[engine_kind])
    greedy = tokens(engine, prompt, 2, decoding(temperature=0))
    assert [t.id for t in items[1:] if isinstance(t, Token)] == [t.id for t in greedy]


def test_echo_with_no_tokens_scores_the_prompt_only(engine: Engine) -> None:
    prompt = engine.text_tokens("hello world")
    d = decoding(None, None, True, temperature=0, max_tokens=0)
    out = run_steps(engine, prompt, d)
    assert isinstance(out[0], ScoredPrompt) and len(out[0].tokens) == len(prompt)
    assert out[0].tokens[0].logprob is None and out[0].tokens[1].logprob is not None
    assert out[0].tokens[1].top == ()  # no alternatives asked for
    assert isinstance(out[1], Step) and out[1].token_id is None and len(out) == 2
    # A one-token prompt has one score, the first token's (none).
    only = next(iter(engine.generate(prompt[:1], d)))
    assert only == PromptScores((Token(prompt[0]),))
