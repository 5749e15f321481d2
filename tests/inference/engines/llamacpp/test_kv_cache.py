"""KV-cache types in the llama.cpp engine, on SmolLM2: a quantized cache decodes batched as
it does alone, and holds what placement counts for it (about 17/32 of f16's for q8_0, 9/32
for q4_0), measured from the cache's own bytes."""

from __future__ import annotations

from collections.abc import Iterator

import llama_cpp
import pytest

from events.kinds import KvCacheType
from inference.engines.llamacpp.engine import LlamaCppEngine
from services.models.footprint import kv_bytes_per_token
from services.models.metadata import model_facts
from tests.inference.engines.llamacpp.test_batch import (
    QUESTIONS,
    SMOLLM2,
    chat,
    greedy,
    run,
    together,
)


def _engine(kv_cache: KvCacheType) -> LlamaCppEngine:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=512, slots=3, n_threads=1, kv_cache=kv_cache)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def q8() -> Iterator[LlamaCppEngine]:
    engine = _engine("q8_0")
    yield engine
    engine.close()


def test_a_q8_0_cache_decodes_together_as_alone(q8: LlamaCppEngine) -> None:
    prompts = [chat(q8, q) for q in QUESTIONS]  # four: one waits for a free slot
    alone = []
    for p in prompts:
        q8.drop_cache()
        alone.append(run(q8.generate(p, greedy()))[0])
    q8.drop_cache()
    assert together(q8, prompts) == alone
    assert all(len(a) > 3 for a in alone)


def held_bytes(kv_cache: KvCacheType, text: str) -> tuple[int, int]:
    """The bytes of KV cache one generation of ``text`` leaves in a new engine's context, as
    llama.cpp saves them (each cell's K and V rows, in the cache's type), and the tokens."""
    engine = _engine(kv_cache)
    try:
        prompt = chat(engine, text)
        run(engine.generate(prompt, greedy(max_tokens=1)))
        ctx = engine.loaded.decoder.ctx
        assert llama_cpp.llama_n_seq_max(ctx) == 1  # one generation: one sequence
        return int(llama_cpp.llama_state_seq_get_size(ctx, 0)), len(prompt)
    finally:
        engine.close()


def test_a_quantized_cache_holds_what_placement_counts() -> None:
    story = "The sea was calm that morning, and the boats went out one by one. " * 20
    text = f"{story}\nTell me about the sea."
    f16, tokens = held_bytes("f16", text)
    # What placement counts a token (SmolLM2-135M: 30 layers of 3 KV heads of 64, K and V,
    # 23,040 bytes in f16), and a few bytes more: the cells' positions, the state's headers.
    per_token = model_facts(SMOLLM2).kv_bytes_per_token
    assert per_token == 23_040
    assert 0 <= f16 - per_token * tokens < 32 * tokens
    for kv in ("q8_0", "q4_0"):
        size, _ = held_bytes(kv, text)
        assert size / f16 == pytest.approx(kv_bytes_per_token(64, kv) / 64, rel=0.005)
