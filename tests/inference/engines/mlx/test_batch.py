"""The MLX engine with several slots (``mlx_batch``: mlx-lm's BatchGenerator), on the tiny
random-weight model: generations decoded together give what each gives alone (the one-slot
engine, today's path), with every sampling feature; a closed one frees its slot; one's error
fails it alone."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from inference.decoding import Decoding, PromptCached, PromptScores, Token
from inference.engines.mlx.engine import PREFILL_STEP, MlxEngine
from structured.reply import Grammar, InvalidRequest
from tests.inference.engines.mlx.test_sampling import (
    SMALL_SCHEMA,
    decoding,
    free_text,
    hex_regex,
    schema_grammar,
)

Item = Token | PromptScores
Given = Item | PromptCached  # what an engine gives: the cached count is left out of results
Job = tuple[list[int], Decoding, int]  # a prompt, how to decode, how many tokens at most


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


@pytest.fixture
def two_slots(tiny_mlx: Path) -> Iterator[MlxEngine]:
    engine = MlxEngine(tiny_mlx, n_ctx=1024, slots=2)
    engine.load()
    yield engine
    engine.close()


def take(engine: MlxEngine, generation: Iterator[Given], n: int) -> list[Item]:
    """The first ``n`` tokens (and the prompt's scores), up to and with an end token."""
    out: list[Item] = []
    tokens = 0
    for item in generation:
        if isinstance(item, PromptCached):
            continue
        out.append(item)
        if isinstance(item, Token):
            tokens += 1
            if engine.is_end(item.id) or tokens >= n:
                break
    return out


def close(generation: Iterator[Given]) -> None:
    assert isinstance(generation, Generator)
    generation.close()


def one_by_one(engine: MlxEngine, jobs: list[Job]) -> list[list[Item]]:
    return [take(engine, engine.generate(prompt, d), n) for prompt, d, n in jobs]


def together(engine: MlxEngine, jobs: list[Job]) -> list[list[Item] | BaseException]:
    """Each job on its own thread, as the runner serves tasks; none goes past its first item
    before every one has had its first (all in flight at once). A job's error is its result."""
    in_flight: list[int] = []
    decoder = engine._decoder
    assert decoder is not None
    barrier = threading.Barrier(len(jobs), action=lambda: in_flight.append(decoder.busy))

    def run(job: Job) -> list[Item] | BaseException:
        prompt, d, n = job
        generation = engine.generate(prompt, d)
        first = True

        def waited() -> Iterator[Given]:
            nonlocal first
            for item in generation:
                yield item
                if first:
                    first = False
                    barrier.wait(timeout=60)

        try:
            return take(engine, waited(), n)
        except InvalidRequest as exc:
            if first:
                barrier.wait(timeout=60)
            return exc
        finally:
            close(generation)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert in_flight == [len(jobs)]
    return results


def ids(items: Sequence[Given] | BaseException) -> list[int]:
    assert not isinstance(items, BaseException)
    return [t.id for t in items if isinstance(t, Token)]


def assert_same(got: list[Item] | BaseException, want: list[Item]) -> None:
    assert isinstance(got, list)
    assert ids(got) == ids(want)
    for g, w in zip(got, want, strict=True):
        pairs: list[tuple[Item, Item]] = [(g, w)]
        if isinstance(g, PromptScores):
            assert isinstance(w, PromptScores)
            pairs = list(zip(g.tokens, w.tokens, strict=True))
        for a, b in pairs:
            assert isinstance(a, Token) and isinstance(b, Token)
            assert (a.logprob is None) == (b.logprob is None)
            if a.logprob is not None and b.logprob is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


HOT: dict[str, Any] = {
    "temperature": 1.3,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.01,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.3,
    "frequency_penalty": 0.3,
}


def test_generations_together_are_each_alone(alone: MlxEngine, batched: MlxEngine) -> None:
    assert batched.slots == 5 and alone.slots == 1
    story = alone.text_tokens("Once upon a time")
    long = alone.text_tokens("the sea is blue, hello world. " * 60)[: PREFILL_STEP + 30]
    jobs: list[Job] = [
        (
            alone.chat_tokens([{"role": "user", "content": "What is the capital?"}], None),
            decoding(temperature=0),
            16,
        ),
        (story, decoding(seed=7, **HOT), 16),
        (story, decoding(schema_grammar(SMALL_SCHEMA), temperature=1.0, seed=2), 60),
        (
            alone.text_tokens("hello hello"),
            decoding(None, 5, temperature=1.5, seed=4, repeat_penalty=1.3, logit_bias={10: 5.0}),
            12,
        ),
        (long, decoding(None, 3, True, temperature=0), 4),
    ]
    want = one_by_one(alone, jobs)
    assert isinstance(want[4][0], PromptScores) and len(want[4][0].tokens) == len(long)
    for got, expected in zip(together(batched, jobs), want, strict=True):
        assert_same(got, expected)
    # And one at a time through the batched engine.
    for got, expected in zip(one_by_one(batched, jobs), want, strict=True):
        assert_same(got, expected)


def test_per_task_seeds_reproduce_together(alone: MlxEngine, batched: MlxEngine) -> None:
    story = alone.text_tokens("Once upon a time")
    jobs: list[Job] = [(story, decoding(seed=s, **HOT), 12) for s in (7, 7, 8, 9)]
    runs = [ids(r) for r in together(batched, jobs)]
    assert runs[0] == runs[1] == ids(one_by_one(alone, jobs[:1])[0])
    assert runs[1] != runs[2] != runs[3]


def test_a_closed_generation_frees_its_slot(alone: MlxEngine, two_slots: MlxEngine) -> None:
    prompts = [alone.text_tokens(t) for t in ("Once upon a time", "hello world", "The sea")]
    want = [ids(take(alone, alone.generate(p, decoding(temperature=0)), 8)) for p in prompts]
    a, b, c = (two_slots.generate(p, decoding(temperature=0)) for p in prompts)
    assert ids(take(two_slots, a, 3)) == want[0][:3]
    got_b = take(two_slots, b, 3)
    first_c: list[Item] = []
    waiting = threading.Thread(target=lambda: first_c.extend(take(two_slots, c, 1)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not first_c  # both slots are taken
    close(a)
    waiting.join(30)
    assert ids(first_c + take(two_slots, c, 7)) == want[2]
    assert ids(got_b + take(two_slots, b, 5)) == want[1]
    close(b)
    close(c)
    decoder = two_slots._decoder
    assert decoder is not None
    for _ in range(100):
        if decoder.busy == 0:
            break
        threading.Event().wait(0.05)
    assert decoder.busy == 0


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
    assert_same(results[0], want[0])
    assert_same(results[2], want[1])


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
