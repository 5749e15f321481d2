"""A pipeline's commands through ``wire``'s encoding, on a ring that hands each array back: what
rank 0 sends is what the next rank reads."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import cast

import mlx.core as mx

from inference.engines.mlx import wire
from inference.engines.mlx.ring import Ring


class Loop:
    """A ring of one: what is sent is received, array by array."""

    rank = 0

    def __init__(self) -> None:
        self.arrays: deque[mx.array] = deque()

    def send(self, header: mx.array, *payloads: mx.array) -> None:
        self.arrays.extend([header, *payloads])

    def recv(self, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
        x = self.arrays.popleft()
        assert tuple(x.shape) == tuple(shape) and x.dtype == dtype, (x.shape, shape)
        return x


def test_a_step_carries_the_tokens_forced_on_its_rows() -> None:
    ring = Loop()
    hidden = mx.zeros((2, 1, 8), dtype=mx.float16)
    wire.send(cast(Ring, ring), wire.Step([3, 1], hidden, [wire.NOT_FORCED, 42]))
    step = wire.receive(cast(Ring, ring), 8)
    assert isinstance(step, wire.Step) and step.slots == [3, 1]
    assert [step.forced_at(0), step.forced_at(1)] == [None, 42]
    # None forced: every row picks.
    wire.send(cast(Ring, ring), wire.Step([0], mx.zeros((1, 1, 8), dtype=mx.float16)))
    step = wire.receive(cast(Ring, ring), 8)
    assert isinstance(step, wire.Step) and step.forced_at(0) is None and not ring.arrays
