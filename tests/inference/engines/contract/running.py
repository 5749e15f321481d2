"""What the contract tests ask of an engine, through its public interface only (``Engine``'s
``generate`` and the runner's ``steps`` over it): a decoding, the first tokens of a
generation, its text, generations run one by one and together."""

from __future__ import annotations

import json
import threading
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from llama_cpp import llama_grammar

from events.records import SamplingParams
from inference.decoding import Decoding, PromptCached, PromptScores, Token
from inference.engines.base import Engine
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.generation import ScoredPrompt, Step, check_request, steps
from structured.reply import Grammar, InvalidRequest

Item = Token | PromptScores
Given = Item | PromptCached  # what an engine gives: the cached count is left out of results
Job = tuple[list[int], Decoding, int]  # a prompt, how to decode, how many tokens at most

# Bounded, so that a random model ends it: strings have a length, arrays a size.
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color", "tags"],
}
# Several sampling features at once.
HOT: dict[str, Any] = {
    "temperature": 1.3,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.01,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.3,
    "frequency_penalty": 0.3,
}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def decoding(
    grammar: Grammar | None = None,
    top_logprobs: int | None = None,
    echo: bool = False,
    **params: Any,
) -> Decoding:
    return Decoding(SamplingParams.model_validate(params), grammar, top_logprobs, echo)


def schema_grammar(schema: dict[str, Any]) -> Grammar:
    """As the runner makes it: llama-cpp-python's converter."""
    return Grammar(llama_grammar.json_schema_to_gbnf(json.dumps(schema)))


def valid(value: Any) -> bool:
    """``value`` is what ``SMALL_SCHEMA`` validates."""
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "ok", "color", "tags"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 6
        and isinstance(value["age"], int)
        and isinstance(value["ok"], bool)
        and value["color"] in ("red", "green", "blue")
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 2
        and all(isinstance(t, str) and len(t) <= 3 for t in value["tags"])
    )


def forget(engine: Engine) -> None:
    """What llama.cpp's KV cache holds is dropped: a run as from a fresh context (a prompt run
    in two pieces rounds a little differently from one run whole). MLX's prompt cache gives
    the rows of a prompt run whole."""
    if isinstance(engine, LlamaCppEngine):
        engine.drop_cache()


def word(engine: Engine, text: str) -> int:
    """The one token of ``text``."""
    (token,) = engine.tokenize(text, add_special=False, parse_special=False)
    return token


def take(engine: Engine, generation: Iterator[Given], n: int) -> list[Item]:
    """The first ``n`` tokens (and the prompt's scores), up to and with an end token."""
    out: list[Item] = []
    count = 0
    for item in generation:
        if isinstance(item, PromptCached):
            continue
        out.append(item)
        if isinstance(item, Token):
            count += 1
            if engine.is_end(item.id) or count >= n:
                break
    return out


def tokens(engine: Engine, prompt: list[int], n: int, d: Decoding) -> list[Token]:
    """The first ``n`` tokens generated, up to and with an end token."""
    return [t for t in take(engine, engine.generate(prompt, d), n) if isinstance(t, Token)]


def ids_of(engine: Engine, prompt: list[int], n: int, **params: Any) -> list[int]:
    return [t.id for t in tokens(engine, prompt, n, decoding(**params))]


def hex_regex(data: bytes) -> str:
    """A regex for exactly these bytes (which may be parts of UTF-8 characters: a random
    model writes such)."""
    return "".join(f"\\x{b:02x}" for b in data)


def free_text(engine: Engine) -> tuple[list[int], list[Token], int]:
    """A prompt, its greedy output, and a token of it, not among the first two, that is two
    ASCII letters or more (after a space, in SmolLM2's words) whose first two bytes the text
    before does not hold: where a test makes a lazy grammar start."""
    prompt = engine.text_tokens("Once upon a time")
    greedy = tokens(engine, prompt, 32, decoding(temperature=0))
    pieces = [engine.piece(t.id) for t in greedy]

    def fits(i: int) -> bool:
        piece = pieces[i]
        letters = piece[1:] if piece.startswith(b" ") else piece
        before = b"".join(pieces[:i]) + piece[:1]
        return i >= 2 and len(letters) >= 2 and letters.isalpha() and piece[:2] not in before

    def letters(i: int) -> bool:  # where the text before may hold its first bytes too
        return i >= 2 and len(pieces[i]) >= 2 and pieces[i].isalpha()

    j = next((i for i in range(len(pieces)) if fits(i)), None)
    if j is None:  # a random model's text that repeats itself (the tied tiny MLX model's)
        j = next(i for i in range(len(pieces)) if letters(i))
    return prompt, greedy, j


def text(engine: Engine, items: Sequence[Token]) -> bytes:
    """The tokens' text, the end token's left out."""
    return b"".join(engine.piece(t.id) for t in items if not engine.is_end(t.id))


def run_steps(engine: Engine, prompt: list[int], d: Decoding) -> list[Step | ScoredPrompt]:
    """As the runner serves a task: the engine's generation through ``steps``, to the end."""
    limit = check_request(len(prompt), d.params, engine.n_ctx, d.echo)
    return list(steps(engine, prompt, d, limit, lambda: False))


def finish(engine: Engine, prompt: list[int], d: Decoding) -> tuple[str, str | None]:
    """The text served and why it ended."""
    out = [s for s in run_steps(engine, prompt, d) if isinstance(s, Step)]
    return "".join(s.text for s in out), out[-1].finish_reason


def close(generation: Iterator[Given]) -> None:
    assert isinstance(generation, Generator)
    generation.close()


def one_by_one(engine: Engine, jobs: list[Job]) -> list[list[Item]]:
    out = []
    for prompt, d, n in jobs:
        forget(engine)
        out.append(take(engine, engine.generate(prompt, d), n))
    return out


def together(engine: Engine, jobs: list[Job]) -> list[list[Item] | BaseException]:
    """Each job on its own thread, as the runner serves tasks; none goes past its first item
    before every one has had its first (all in flight at once: the barrier breaks if one of
    them cannot start while the others hold theirs). A job's error is its result."""
    barrier = threading.Barrier(len(jobs))
    forget(engine)

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
                    barrier.wait(timeout=120)

        try:
            return take(engine, waited(), n)
        except InvalidRequest as exc:
            if first:
                barrier.wait(timeout=120)
            return exc
        finally:
            close(generation)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def ids(items: Sequence[Given] | BaseException) -> list[int]:
    assert not isinstance(items, BaseException), items
    return [t.id for t in items if isinstance(t, Token)]


def assert_same(got: list[Item] | BaseException, want: list[Item], abs: float) -> None:
    """The same tokens, and the same log-probabilities (within ``abs``) where they were asked
    for, with the same alternatives (but where two are within ``abs`` at the last place)."""
    assert isinstance(got, list), got
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
                assert a.logprob == pytest.approx(b.logprob, abs=abs)
                assert len(a.top) == len(b.top)
                theirs, ours = dict(b.top), dict(a.top)
                for token, lp in ours.items():
                    if token in theirs:
                        assert lp == pytest.approx(theirs[token], abs=abs)
                    else:  # a near tie at the last place
                        assert lp == pytest.approx(b.top[-1][1], abs=2 * abs)
