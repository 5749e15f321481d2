"""The shared batching loop (``batch_loop.py``) with a scripted step in place of an engine's:
admission in order up to the slots, a pushed generation's items in its sink, a pulled one at its
consumer's pace, a prefill told to stop ending between steps, a consumer that leaves freeing its
slot (and its generation out of the loop when ``close()`` returns), a failed step or a closed
loop failing what is in flight."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from events.records import SamplingParams
from inference.decoding import Decoding, PromptCached, PromptScores, Token
from inference.decoding import Sink as SinkLike
from inference.engines.batch_loop import BatchLoop, Generation, max_new

Item = Token | PromptScores | PromptCached


@dataclass(eq=False)
class Scripted(Generation):
    chunks: int = 0  # prefill steps left before its first token


class Sink:
    """A pushing consumer's sink: keeps what it takes, wants ``wanted`` tokens."""

    def __init__(self, wanted: int = 1000) -> None:
        self.items: list[Item] = []
        self.wanted = wanted
        self.ended = threading.Event()
        self.error: BaseException | None = None

    def take(self, item: Item) -> bool:
        self.items.append(item)
        return sum(isinstance(i, Token) for i in self.items) < self.wanted

    def done(self, error: BaseException | None) -> None:
        assert not self.ended.is_set(), "done is called once"
        self.error = error
        self.ended.set()

    def ready(self) -> bool:
        return True

    def tokens(self) -> list[int]:
        return [i.id for i in self.items if isinstance(i, Token)]


class Counting(BatchLoop[Scripted]):
    """Each step: a prefill chunk for a prompt, else the next token (its prompt's length plus
    how many it made) for each sequence stepped; records who was in each step."""

    def __init__(self, slots: int, fail_at: int | None = None) -> None:
        self.steps: list[list[int]] = []  # per step, the first prompt token of each stepped
        self.admitted: list[int] = []
        self.forgotten: list[int] = []
        self._fail_at = fail_at
        super().__init__(slots, "test-loop")

    def generation(
        self, prompt: list[int], sink: SinkLike, chunks: int = 0, decoding: Decoding | None = None
    ) -> Scripted:
        d = decoding or Decoding(SamplingParams(max_tokens=5))
        return Scripted(prompt, d, max_new(prompt, d, 100), sink, chunks=chunks)

    def _admit(self, gen: Scripted) -> None:
        self.admitted.append(gen.prompt[0])

    def _forget(self, gen: Scripted) -> None:
        self.forgotten.append(gen.prompt[0])

    def _step(self, ready: list[Scripted]) -> None:
        if self._fail_at is not None and len(self.steps) == self._fail_at:
            raise RuntimeError("the step failed")
        self.steps.append([g.prompt[0] for g in ready])
        for gen in ready:
            if gen.chunks:
                gen.chunks -= 1
                continue
            if gen.emit(Token(len(gen.prompt) + gen.given)) and gen.given >= gen.max_new:
                gen.end()


@pytest.fixture
def loop() -> Iterator[Counting]:
    made = Counting(slots=2)
    yield made
    made.close()


def test_pushed_generations_are_admitted_in_order_up_to_the_slots(loop: Counting) -> None:
    sinks = [Sink() for _ in range(3)]
    for k, sink in enumerate(sinks):
        loop.push(loop.generation([10 * (k + 1)] * (k + 1), sink))
    for sink in sinks:
        assert sink.ended.wait(10) and sink.error is None
    assert [s.tokens() for s in sinks] == [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [3, 4, 5, 6, 7]]
    assert loop.admitted == [10, 20, 30]
    assert all(len(step) <= 2 for step in loop.steps)  # never more than the slots
    assert 30 not in [g for step in loop.steps[:5] for g in step]  # the third waited


def test_a_sink_that_wants_no_more_frees_its_slot(loop: Counting) -> None:
    short, other = Sink(wanted=2), Sink()
    loop.push(loop.generation([1], short))
    loop.push(loop.generation([2, 2], other))
    assert short.ended.wait(10) and other.ended.wait(10)
    assert short.tokens() == [1, 2]
    assert loop.forgotten[0] == 1


def test_a_pulled_generation_goes_at_its_consumers_pace(loop: Counting) -> None:
    pulled = loop.pull(lambda sink: loop.generation([7], sink))
    assert next(pulled) == Token(1)
    threading.Event().wait(0.1)
    assert len(loop.steps) == 1  # nothing decoded ahead of the consumer (lookahead 1)
    assert next(pulled) == Token(2)
    pulled.close()
    # Once closed, the generation is out of the loop.
    assert loop.forgotten == [7] and loop.busy == 0


def test_a_prefill_told_to_stop_ends_between_steps(loop: Counting) -> None:
    stop = threading.Event()
    sink = Sink()
    told = Decoding(SamplingParams(max_tokens=5), cancelled=stop.is_set)
    loop.push(loop.generation([3] * 4, sink, chunks=10**9, decoding=told))
    threading.Event().wait(0.05)
    stop.set()
    assert sink.ended.wait(10)
    assert sink.error is None and sink.tokens() == []


def test_a_failed_step_fails_what_is_in_flight_and_the_engine_serves_no_more() -> None:
    loop = Counting(slots=2, fail_at=2)
    try:
        sinks = [Sink(), Sink()]
        for sink in sinks:
            loop.push(loop.generation([1], sink))
        for sink in sinks:
            assert sink.ended.wait(10)
            assert isinstance(sink.error, RuntimeError)
        with pytest.raises(RuntimeError, match="the step failed"):
            loop.push(loop.generation([1], Sink()))
    finally:
        loop.close()


def test_closing_fails_what_is_in_flight() -> None:
    loop = Counting(slots=1)
    sink, waiting = Sink(), Sink()
    loop.push(loop.generation([1], sink, chunks=10**9))  # prefills for ever
    loop.push(loop.generation([2], waiting))
    loop.close()
    for s in (sink, waiting):
        assert s.ended.is_set() and isinstance(s.error, RuntimeError)
