"""The MLX engines' prompt cache, on the tiny random-weight model, with one slot and with a
batch: a conversation's next turn starts from the cache its first turn left and gives what an
engine without that cache gives; a generation let go early leaves its cache too; a prompt
that is scored runs whole; at most ``slots`` caches are kept."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import pytest

from inference.decoding import PromptCached, PromptScores, Token
from inference.engines.mlx.engine import MlxEngine
from inference.engines.mlx.prompt_cache import PromptCaches
from tests.inference.engines.contract.running import decoding, text

Item = Token | PromptScores | PromptCached


@pytest.fixture(params=[1, 3], ids=["one-slot", "batched"])
def engine(request: pytest.FixtureRequest, tiny_mlx: Path) -> Iterator[MlxEngine]:
    engine = MlxEngine(tiny_mlx, n_ctx=512, slots=request.param)
    engine.load()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def fresh(tiny_mlx: Path) -> MlxEngine:
    """What a prompt gives run whole: the cache is emptied before each use."""
    engine = MlxEngine(tiny_mlx, n_ctx=512)
    engine.load()
    return engine


def run(engine: MlxEngine, prompt: list[int], n: int, **params: Any) -> tuple[list[Token], int]:
    """The first ``n`` tokens (fewer at an end token), with their log-probabilities, and how
    many of the prompt's tokens were cached."""
    tokens: list[Token] = []
    cached = 0
    generation = engine.generate(prompt, decoding(None, 1, **params))
    for item in generation:
        if isinstance(item, PromptCached):
            assert not tokens, "the cached count comes before the first token"
            cached = item.tokens
        elif isinstance(item, Token):
            tokens.append(item)
            if engine.is_end(item.id) or len(tokens) >= n:
                break
    generation.close()  # type: ignore[attr-defined]
    return tokens, cached


def whole(fresh: MlxEngine, prompt: list[int], n: int, **params: Any) -> list[Token]:
    kept = fresh._kept
    assert kept is not None
    kept.clear()
    tokens, cached = run(fresh, prompt, n, **params)
    assert cached == 0
    return tokens


def assert_same(got: list[Token], want: list[Token]) -> None:
    assert [t.id for t in got] == [t.id for t in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob is not None and w.logprob is not None
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)


def test_a_next_turn_starts_from_the_first_turns_cache(engine: MlxEngine, fresh: MlxEngine) -> None:
    chat = [{"role": "user", "content": "Tell me about the sea."}]
    first = engine.chat_tokens(chat, None)
    answer, cached = run(engine, first, 12, temperature=0)
    assert cached == 0
    assert_same(answer, whole(fresh, first, 12, temperature=0))
    reply = text(engine, answer).decode(errors="replace")
    chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the sky?"}]
    second = engine.chat_tokens(chat, None)
    assert second[: len(first)] == first
    again, cached = run(engine, second, 12, temperature=0)
    assert len(first) <= cached < len(second)
    assert_same(again, whole(fresh, second, 12, temperature=0))


def test_the_same_prompt_again_runs_only_its_last_token(
    engine: MlxEngine, fresh: MlxEngine
) -> None:
    prompt = engine.text_tokens("The lighthouse keeper counted the ships at night")
    first, _ = run(engine, prompt, 6, seed=5, temperature=0.8)
    again, cached = run(engine, prompt, 6, seed=5, temperature=0.8)
    assert cached == len(prompt) - 1
    assert [t.id for t in again] == [t.id for t in first]
    assert [t.id for t in again] == [t.id for t in whole(fresh, prompt, 6, seed=5, temperature=0.8)]


def test_a_generation_let_go_early_leaves_its_cache(engine: MlxEngine) -> None:
    prompt = engine.text_tokens("hello world, " * 20)
    generation = engine.generate(prompt, decoding(temperature=0))
    taken = list(islice((t for t in generation if isinstance(t, Token)), 3))
    generation.close()  # type: ignore[attr-defined]
    assert len(taken) == 3
    _, cached = run(engine, prompt + [t.id for t in taken] + [5, 6], 2, temperature=0)
    # The prompt and at least the tokens taken before it was let go (the batch may be ahead).
    assert cached >= len(prompt) + 2


def test_a_scored_prompt_is_run_whole(engine: MlxEngine) -> None:
    prompt = engine.text_tokens("Once upon a time in a quiet harbour")
    run(engine, prompt, 4, temperature=0)
    items = list(engine.generate(prompt, decoding(None, 2, True, temperature=0, max_tokens=1)))
    assert not any(isinstance(i, PromptCached) for i in items)
    assert isinstance(items[0], PromptScores) and len(items[0].tokens) == len(prompt)


def test_unrelated_prompts_share_nothing_and_at_most_slots_caches_are_kept(
    tiny_mlx: Path,
) -> None:
    engine = MlxEngine(tiny_mlx, n_ctx=512, slots=2)
    engine.load()
    try:
        decoder = engine._decoder
        assert decoder is not None
        kept: PromptCaches = decoder._kept
        for text in ("apples and pears", "boats on water", "clouds in the sky"):
            _, cached = run(engine, engine.text_tokens(text)[1:], 3, temperature=0)
            assert cached == 0
        assert len(kept) == 2
    finally:
        engine.close()
