"""A task resumed after its runner was lost: the engine goes on after the tokens generated before
(prefilled with the prompt, taken by the sampler as its own), so that greedy goes on as an
uninterrupted run would, penalties count the earlier tokens, and a grammar's output still
matches; and a runner's steps go on at the next index. On every engine, one generation at a
time and batched."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from llama_cpp.llama_grammar import json_schema_to_gbnf

from events.catalogue import Resume, TaskCreated
from events.records import SamplingParams
from inference.decoding import Decoding
from inference.engines.base import Engine
from inference.generation import Step, check_request, steps
from inference.job import continued_seed, prepare
from structured.reply import Grammar
from tests.inference.engines.contract.running import user

CUT = 9  # tokens generated before the runner was "lost"
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 12},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "student"],
}


def run(engine: Engine, prompt: list[int], d: Decoding) -> list[Step]:
    limit = check_request(len(prompt), d.params, engine.n_ctx)
    return [s for s in steps(engine, prompt, d, limit, lambda: False) if isinstance(s, Step)]


def cases(engine: Engine) -> list[tuple[list[int], Decoding]]:
    prompt = engine.chat_tokens(user("Write a short poem about the sea."), None)
    person = Grammar(json_schema_to_gbnf(json.dumps(PERSON)))
    greedy = SamplingParams(temperature=0, max_tokens=40)
    return [
        (prompt, Decoding(greedy)),
        # Penalties over the generated tokens: the earlier ones count.
        (
            prompt,
            Decoding(greedy.model_copy(update={"repeat_penalty": 1.5, "frequency_penalty": 1.0})),
        ),
        (
            engine.chat_tokens(user("Describe a person as JSON."), None),
            Decoding(greedy.model_copy(update={"max_tokens": 200}), person),
        ),
    ]


def check_goes_on_as_uninterrupted(engine: Engine) -> None:
    for prompt, d in cases(engine):
        whole = run(engine, prompt, d)
        before = [s.token_id for s in whole[:CUT]]
        assert all(t is not None for t in before)
        resumed = run(engine, prompt, dataclasses.replace(d, generated=tuple(before)))  # type: ignore[arg-type]
        # The steps go on at the next index, as the whole run's did.
        assert [s.idx for s in resumed] == [s.idx for s in whole[CUT:]]
        assert [(s.token_id, s.finish_reason) for s in resumed] == [
            (s.token_id, s.finish_reason) for s in whole[CUT:]
        ]
        text = "".join(s.text for s in whole)
        assert "".join(s.text for s in whole[:CUT] + resumed) == text
        if d.grammar is not None:  # the tiny model's strings hold control characters
            assert whole[-1].finish_reason == "stop"
            assert json.loads(text, strict=False).keys() == PERSON["properties"].keys()
        if d.params.repeat_penalty != 1.0:  # the penalties made a difference to count
            plain = run(
                engine,
                prompt,
                Decoding(
                    d.params.model_copy(update={"repeat_penalty": 1.0, "frequency_penalty": 0.0})
                ),
            )
            assert [s.token_id for s in plain] != [s.token_id for s in whole]


def test_it_goes_on_as_an_uninterrupted_run(engine: Engine) -> None:
    check_goes_on_as_uninterrupted(engine)


def test_batched_it_goes_on_as_an_uninterrupted_run(batched: Engine) -> None:
    check_goes_on_as_uninterrupted(batched)


def test_a_resumed_task_prepares_to_go_on(engine: Engine) -> None:
    task = TaskCreated(
        task_id="t",
        model_id="m",
        origin="test",
        kind="completion",
        prompt="Once upon a time",
        echo=True,
        logprobs=1,
        params=SamplingParams(seed=7, temperature=0.8),
    )
    fresh = prepare(engine, task)
    again = prepare(engine, task.model_copy(update={"resume": Resume(attempt=1, tokens=[5, 6])}))
    assert again.prompt == fresh.prompt and again.decoding.generated == (5, 6)
    # Its prompt's scores were given already; its draws go on with a seed of their own.
    assert fresh.decoding.echo and not again.decoding.echo
    assert again.decoding.params.seed == continued_seed(7, 2) != 7
    assert continued_seed(7, 2) == continued_seed(7, 2) != continued_seed(7, 3)
    assert again.decoding.top_logprobs == 1
    outside = task.model_copy(update={"resume": Resume(attempt=1, tokens=[10**7])})
    with pytest.raises(Exception, match="the generated text has token 10000000"):
        prepare(engine, outside)
