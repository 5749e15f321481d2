"""A task's generation on its engine, its steps coming to the runner's event loop in groups.

Every engine decodes on a thread of its own (``engines/batch_loop.py``) and hands each
generation's items to a sink there: ``FeedSink`` makes them into steps on that thread, between
two of the engine's steps (no thread is woken per token), and puts them on a ``StepFeed``, which
the loop takes in groups. ``Generating`` is what the runner sees of it: the groups, then the
outcome, and the engine never left running.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from types import TracebackType

from inference.decoding import PromptCached, PromptScores, Token
from inference.engines.base import Engine
from inference.generation import Stepper
from inference.job import Job
from inference.step_feed import Made, StepFeed


class FeedSink:
    """A generation's items from an engine's thread: made into steps there (between two
    steps of the engine) and put on the feed; the future says when it ended, and how."""

    def __init__(self, stepper: Stepper, feed: StepFeed, ended: asyncio.Future[None]) -> None:
        self._stepper = stepper
        self._feed = feed
        self._ended = ended
        self._loop = ended.get_loop()

    def take(self, item: Token | PromptScores | PromptCached) -> bool:
        made, more = self._stepper.take(item)
        for step in made:
            self._feed.put(step)
        return more

    def done(self, error: BaseException | None) -> None:
        try:
            if error is None:
                self._feed.put(self._stepper.finish())
        except Exception as exc:  # a reply parser's error: the task's, as from the engine
            error = exc
        finally:
            self._feed.close()
            self._loop.call_soon_threadsafe(self._end, error)

    def _end(self, error: BaseException | None) -> None:
        if not self._ended.done():
            if error is None:
                self._ended.set_result(None)
            else:
                self._ended.set_exception(error)

    def ready(self) -> bool:
        return True


class Generating:
    """Generates at most ``limit`` tokens of ``job`` on ``engine`` (a resumed task's
    ``decoding.generated`` taken as generated, the engine going on after them), stopping when
    ``cancelled`` says so; steps come in groups at most ``window_s`` apart (``StepFeed``).
    Used as ``async with``: iterated, the groups of steps made; on leaving, the engine is told
    to stop and waited for; then ``outcome()`` raises the engine's error, if it had one. What
    the engine refuses at once (``InvalidRequest``) is raised here. ``on_cached`` is told, on
    the engine's thread, how many of the prompt's tokens its cache held."""

    def __init__(
        self,
        engine: Engine,
        job: Job,
        limit: int,
        cancelled: Callable[[], bool],
        window_s: float,
        on_cached: Callable[[int], None] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._feed = StepFeed(loop, window_s)
        self._ended: asyncio.Future[None] = loop.create_future()
        self._stopping = threading.Event()  # the consumer left: the engine stops too

        def stop_asked() -> bool:
            return cancelled() or self._stopping.is_set()

        # The engine asks it between prefill chunks too, the stepper between tokens.
        decoding = replace(job.decoding, cancelled=stop_asked)
        stepper = Stepper(engine, decoding, limit, stop_asked, job.reply, on_cached)
        sink = FeedSink(stepper, self._feed, self._ended)
        generated = list(decoding.generated)
        if stepper.replay(generated):
            engine.submit(job.prompt + generated, decoding, sink)
        else:  # a continuation with nothing left to make: its last step alone
            sink.done(None)

    async def __aenter__(self) -> Generating:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopping.set()
        await asyncio.wait({self._ended})  # the engine is never left running
        if exc is not None:
            self._ended.exception()  # what left first is what is raised: the engine's is seen

    def __aiter__(self) -> AsyncIterator[list[Made]]:
        return self._groups()

    async def _groups(self) -> AsyncIterator[list[Made]]:
        # What was generated before an engine error still comes: every step is given.
        while (made := await self._feed.next_group()) is not None:
            yield made

    def outcome(self) -> None:
        """Once left: the engine's error, if it raised one."""
        self._ended.result()
