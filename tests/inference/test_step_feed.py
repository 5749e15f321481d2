"""The hand-over of steps from the engine's thread to the event loop, with a real thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from inference.generation import Step
from inference.step_feed import FIRST_WAIT_S, Made, StepFeed


def tokens(n: int) -> list[Step]:
    return [Step(i, f"t{i}", 100 + i) for i in range(n)] + [Step(n, "", None, "length")]


async def take_all(feed: StepFeed) -> list[list[Made]]:
    groups = []
    while (group := await asyncio.wait_for(feed.next_group(), 5)) is not None:
        groups.append(group)
    return groups


def engine(
    feed: StepFeed, made: list[Step], pause_s: float, fail: bool = False
) -> Callable[[], None]:
    def run() -> None:
        try:
            for step in made:
                feed.put(step)
                time.sleep(pause_s)
                if fail:
                    raise RuntimeError("engine error")
        finally:
            feed.close()

    return run


async def test_the_engine_waits_for_the_first_token_to_be_taken_but_not_for_ever() -> None:
    feed = StepFeed(asyncio.get_running_loop(), window_s=0.05)
    made = tokens(40)
    began = time.monotonic()
    # The loop looks only once the engine is done: the engine waited for it, then went on.
    await asyncio.to_thread(engine(feed, made, pause_s=0.0))
    assert FIRST_WAIT_S <= time.monotonic() - began < FIRST_WAIT_S + 2
    groups = await take_all(feed)
    assert [m.step for g in groups for m in g] == made


async def test_a_slow_loop_gets_everything_in_order_and_a_fast_one_gets_groups() -> None:
    loop = asyncio.get_running_loop()
    feed = StepFeed(loop, window_s=0.05)
    made = tokens(30)
    thread = threading.Thread(target=engine(feed, made, pause_s=0.005))
    thread.start()
    groups = await take_all(feed)
    thread.join()
    assert [m.step for g in groups for m in g] == made
    # The first token alone at once; then groups ~50 ms apart (10 tokens of 5 ms), not one
    # wake-up per token; the last step closes its group.
    assert [m.step for m in groups[0]] == made[:1]
    assert 2 < len(groups) < 15
    last = groups[-1][-1].step
    assert isinstance(last, Step) and last.finish_reason == "length"
    at = [m.at for g in groups for m in g]
    assert at == sorted(at)


async def test_the_steps_before_an_engine_error_are_all_taken() -> None:
    loop = asyncio.get_running_loop()
    feed = StepFeed(loop, window_s=10.0)
    made = tokens(5)
    errors: list[Exception] = []

    def failing() -> None:
        try:
            engine(feed, made, pause_s=0.0, fail=True)()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=failing)
    thread.start()
    groups = await take_all(feed)
    thread.join()
    assert [m.step for g in groups for m in g] == made[:1]
    assert [str(e) for e in errors] == ["engine error"]


async def test_a_feed_closed_without_steps_ends_at_once() -> None:
    feed = StepFeed(asyncio.get_running_loop(), window_s=0.05)
    await asyncio.to_thread(feed.close)
    assert await asyncio.wait_for(feed.next_group(), 5) is None
    assert await asyncio.wait_for(feed.next_group(), 5) is None
