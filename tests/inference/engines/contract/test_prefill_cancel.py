"""A task cancelled while its prompt is prefilled stops within one chunk (llama.cpp's
``n_batch``, MLX's ``PREFILL_STEP``: 512 tokens each), not at the end of the prefill, on one
slot and on several; and the engine serves the next prompt. The engine looks at the task's
``cancelled`` once before each chunk: told at the second look, one chunk ran."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from events.records import SamplingParams
from inference.decoding import Decoding, Token
from inference.engines.base import Engine
from inference.engines.mlx.engine import PREFILL_STEP
from tests.inference.engines.contract.conftest import close, make


@pytest.fixture(params=[1, 2], ids=["one-slot", "batched"])
def slotted(engine_kind: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    made = make(engine_kind, request, slots=request.param)
    yield made
    close(made)


def test_a_prompt_cancelled_during_its_prefill_stops_within_one_chunk(slotted: Engine) -> None:
    prompt = [50 + (i * 7) % 300 for i in range(1000)]
    assert len(prompt) > PREFILL_STEP + 1  # two chunks (and MLX's last token, apart)
    looks: list[bool] = []

    def cancelled() -> bool:  # told once the first chunk is under way
        looks.append(bool(looks))
        return looks[-1]

    greedy = SamplingParams(temperature=0, max_tokens=4)
    items = list(slotted.generate(prompt, Decoding(greedy, cancelled=cancelled)))
    assert not [i for i in items if isinstance(i, Token)]
    assert looks == [False, True]  # a look before each chunk: one chunk ran
    again = slotted.generate(prompt[:20], Decoding(greedy))
    assert isinstance(next(i for i in again if isinstance(i, Token)), Token)
