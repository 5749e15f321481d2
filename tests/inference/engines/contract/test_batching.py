"""Generations decoded together give what each gives alone, with every sampling feature
(greedy, seeded sampling, a grammar, log-probabilities, a prompt's scores over several
chunks); a closed one frees its slot for a waiting one; the engine serving one generation at
a time and the one serving several give the same."""

from __future__ import annotations

import threading
from typing import Any

from inference.decoding import PromptScores
from inference.engines.base import Engine
from inference.engines.llamacpp.batch_plan import ECHO_CHUNK
from inference.engines.mlx.engine import PREFILL_STEP
from tests.inference.engines.contract.conftest import BATCH
from tests.inference.engines.contract.running import (
    HOT,
    SMALL_SCHEMA,
    Item,
    Job,
    assert_same,
    close,
    decoding,
    forget,
    ids,
    one_by_one,
    schema_grammar,
    take,
    together,
    user,
)

# How far a generation's log-probabilities batched are from alone: llama.cpp computes a step of
# several sequences with other shapes (other kernels, activations quantized for a quantized
# model's matrices), which moves SmolLM2's log-probabilities by up to a third at unlikely
# alternatives (the tokens are the same): half a unit tells a row of another position; MLX
# computes each sequence's rows as alone.
TOLERANCE = {"llamacpp": 0.5, "mlx": 1e-4}
# A scored prompt of several chunks: MLX's prefill chunks, llama.cpp's chunks of a scored
# prompt (``ECHO_CHUNK``).
LONG = {"llamacpp": 2 * ECHO_CHUNK + 30, "mlx": PREFILL_STEP + 30}
QUESTIONS = (
    "What is the capital of France?",
    "Name three colours.",
    "Count to five.",
    "Say hello in Spanish.",
)


def test_generations_together_are_each_alone(
    engine: Engine, batched: Engine, engine_kind: str
) -> None:
    assert batched.slots == BATCH and engine.slots == 1
    story = engine.text_tokens("Once upon a time")
    long = engine.text_tokens("the sea is blue, hello world. " * 100)[: LONG[engine_kind]]
    assert len(long) == LONG[engine_kind]
    jobs: list[Job] = [
        (engine.chat_tokens(user(QUESTIONS[0]), None), decoding(temperature=0), 16),
        (story, decoding(seed=7, **HOT), 16),
        (story, decoding(schema_grammar(SMALL_SCHEMA), temperature=1.0, seed=2), 60),
        (
            engine.text_tokens("hello hello"),
            decoding(None, 5, temperature=1.5, seed=4, repeat_penalty=1.3, logit_bias={10: 5.0}),
            12,
        ),
        (long, decoding(None, 3, True, temperature=0), 4),
    ]
    assert len(jobs) == BATCH
    want = one_by_one(engine, jobs)
    assert isinstance(want[4][0], PromptScores) and len(want[4][0].tokens) == len(long)
    assert all(len(ids(w)) > 3 for w in want)
    for got, expected in zip(together(batched, jobs), want, strict=True):
        assert_same(got, expected, TOLERANCE[engine_kind])
    # And one at a time through the batched engine.
    for got, expected in zip(one_by_one(batched, jobs), want, strict=True):
        assert_same(got, expected, TOLERANCE[engine_kind])


def test_greedy_chats_together_are_each_alone(engine: Engine, batched: Engine) -> None:
    jobs: list[Job] = [
        (engine.chat_tokens(user(q), None), decoding(temperature=0), 16) for q in QUESTIONS
    ]
    want = [ids(w) for w in one_by_one(engine, jobs)]
    assert [ids(r) for r in together(batched, jobs)] == want
    # Greedy is deterministic.
    assert [ids(r) for r in one_by_one(engine, jobs)] == want


def test_per_task_seeds_reproduce_together(engine: Engine, batched: Engine) -> None:
    story = engine.text_tokens("Once upon a time")
    jobs: list[Job] = [(story, decoding(seed=s, **HOT), 12) for s in (7, 7, 8, 9)]
    runs = [ids(r) for r in together(batched, jobs)]
    assert runs[0] == runs[1] == ids(one_by_one(engine, jobs[:1])[0])
    assert runs[1] != runs[2] != runs[3]


def test_a_closed_generation_frees_its_slot(engine: Engine, two_slots: Engine) -> None:
    prompts = [engine.chat_tokens(user(q), None) for q in QUESTIONS[:3]]
    greedy: dict[str, Any] = {"temperature": 0}
    want = [ids(w) for w in one_by_one(engine, [(p, decoding(**greedy), 8) for p in prompts])]
    forget(two_slots)
    a, b, c = (two_slots.generate(p, decoding(**greedy)) for p in prompts)
    assert ids(take(two_slots, a, 3)) == want[0][:3]
    got_b = take(two_slots, b, 3)
    first_c: list[Item] = []
    waiting = threading.Thread(target=lambda: first_c.extend(take(two_slots, c, 1)))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive() and not first_c  # both slots are taken
    close(a)  # its slot is free at the next step: the waiting generation has it
    waiting.join(60)
    assert ids(first_c + take(two_slots, c, 7)) == want[2]
    assert ids(got_b + take(two_slots, b, 5)) == want[1]
    close(b)
    close(c)
    # Both slots are free again: two generations in flight at once.
    jobs: list[Job] = [(p, decoding(**greedy), 8) for p in prompts[:2]]
    assert [ids(r) for r in together(two_slots, jobs)] == want[:2]
