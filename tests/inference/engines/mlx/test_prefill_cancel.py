"""A task cancelled while the MLX engine prefills its prompt stops within one chunk, on one slot
(the generation's own loop) and on several (the decoding thread and mlx-lm's BatchGenerator),
and the engine serves the next prompt (the tiny random-weight model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.records import SamplingParams
from inference.decoding import Decoding, Token
from inference.engines.mlx.engine import PREFILL_STEP, MlxEngine


@pytest.mark.parametrize("slots", [1, 2])
def test_a_prompt_cancelled_during_its_prefill_stops_within_one_chunk(
    tiny_mlx: Path, slots: int
) -> None:
    engine = MlxEngine(tiny_mlx, n_ctx=1024, slots=slots)
    engine.load()
    try:
        prompt = [50 + (i * 7) % 300 for i in range(1000)]
        assert len(prompt) > PREFILL_STEP + 1  # two chunks, then the last token
        looks: list[bool] = []

        def cancelled() -> bool:  # told once the first chunk is under way
            looks.append(bool(looks))
            return looks[-1]

        greedy = SamplingParams(temperature=0, max_tokens=4)
        items = list(engine.generate(prompt, Decoding(greedy, cancelled=cancelled)))
        assert not [i for i in items if isinstance(i, Token)]
        assert looks == [False, True]  # a look before each chunk: one chunk ran
        again = engine.generate(prompt[:20], Decoding(greedy))
        assert isinstance(next(i for i in again if isinstance(i, Token)), Token)
    finally:
        engine.close()
