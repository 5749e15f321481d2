"""The MLX engine with several slots (``mlx_batch``: mlx-lm's BatchGenerator), on the tiny
random-weight model, beyond what every engine does (``contract/test_batching.py``: together as
alone, a closed generation's slot): one's error fails it alone, the generation ends by itself,
what it cannot serve is refused at once, closing it fails what is in flight."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.decoding import PromptScores, Token
from inference.engines.mlx.engine import MlxEngine
from structured.reply import Grammar, InvalidRequest
from tests.inference.engines.contract.running import (
    HOT,
    Job,
    assert_same,
    decoding,
    free_text,
    hex_regex,
    ids,
    one_by_one,
    take,
    together,
)


@pytest.fixture(scope="module")
def alone(tiny_mlx: Path) -> MlxEngine:
    engine = MlxEngine(tiny_mlx, n_ctx=1024)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def batched(tiny_mlx: Path) -> Iterator[MlxEngine]:
    engine = MlxEngine(tiny_mlx, n_ctx=1024, slots=5)
    engine.load()
    yield engine
    engine.close()


def test_one_sequences_error_fails_it_alone(alone: MlxEngine, batched: MlxEngine) -> None:
    prompt, greedy, j = free_text(alone)
    # Once triggered, the grammar cannot take the text: that task fails, the others go on.
    bad = Grammar('root ::= "zzz"', (hex_regex(alone.piece(greedy[j].id)),))
    chat = alone.text_tokens("What is the capital city of France?")
    jobs: list[Job] = [
        (prompt, decoding(temperature=0), 24),
        (prompt, decoding(bad, temperature=0), 24),
        (chat, decoding(seed=3, **HOT), 24),
    ]
    results = together(batched, jobs)
    assert isinstance(results[1], InvalidRequest) and "does not fit" in str(results[1])
    want = one_by_one(alone, jobs[::2])
    assert_same(results[0], want[0], 1e-4)
    assert_same(results[2], want[1], 1e-4)


def test_it_stops_at_an_end_token_max_tokens_and_the_context(
    batched: MlxEngine, tiny_mlx: Path
) -> None:
    prompt = batched.text_tokens("Once upon a time")
    # The generation ends by itself: nothing past these.
    assert len(ids(list(batched.generate(prompt, decoding(temperature=0, max_tokens=5))))) == 5
    end = batched.text.ends[0]
    forced = take(
        batched, batched.generate(prompt, decoding(temperature=0, logit_bias={end: 100.0})), 9
    )
    assert ids(forced) == [end]
    only = list(batched.generate(prompt, decoding(None, None, True, max_tokens=0)))
    assert len(only) == 1 and isinstance(only[0], PromptScores)
    small = MlxEngine(tiny_mlx, n_ctx=24, slots=2)
    small.load()
    try:
        chat = small.chat_tokens(
            [{"role": "user", "content": "What is the capital city of France?"}], None
        )
        assert len(chat) == 21
        assert len(ids(list(small.generate(chat, decoding(temperature=0))))) == 3
    finally:
        small.close()


def test_what_it_cannot_serve_is_refused_at_once(batched: MlxEngine) -> None:
    prompt = batched.text_tokens("hello")
    with pytest.raises(InvalidRequest, match="logit_bias names token 400"):
        batched.generate(prompt, decoding(logit_bias={400: 1.0}))
    with pytest.raises(InvalidRequest, match="GBNF"):
        batched.generate(prompt, decoding(Grammar('root ::= "a" (')))
    with pytest.raises(InvalidRequest, match="context"):
        batched.generate([5] * batched.n_ctx, decoding())


def test_closing_the_engine_fails_what_is_in_flight(tiny_mlx: Path) -> None:
    engine = MlxEngine(tiny_mlx, n_ctx=256, slots=2)
    engine.load()
    generation = engine.generate(engine.text_tokens("hello"), decoding(temperature=0))
    assert isinstance(next(generation), Token)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(generation)
    with pytest.raises(RuntimeError, match="closed"):
        next(engine.generate(engine.text_tokens("hello"), decoding(temperature=0)))
