"""A generation's items, from a batch decoder's thread to the runner's event loop."""

from __future__ import annotations

import asyncio

from inference.decoding import PromptCached, PromptScores, Token
from inference.generation import Stepper
from inference.step_feed import StepFeed


class FeedSink:
    """A generation's items from a batch decoder's thread: made into steps there (between two
    decodes) and put on the feed; the future says when it ended, and how."""

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
