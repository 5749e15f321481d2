"""The thread that decodes an MLX engine's generations together, and the consumers' side of it.

Generations are admitted between steps, up to ``slots`` at once, in the order they came. Each
is a Python generator on its consumer's thread (the runner's ``steps``), fed through a queue
from the decoding thread, the only one that makes the engine's calls (mlx streams are per
thread; a pipeline's ring is one conversation). A consumer that stops taking (a stop string, a
cancel) frees its slot at the next step. What a step computes is the subclass's: mlx-lm's
``BatchGenerator`` for a whole model (``mlx_batch``), the ring's stages for a split one
(``mlx_head``).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from inference.decoding import Decoding, PromptCached, PromptScores, Token

log = logging.getLogger(__name__)

# Tokens a sequence may be ahead of its consumer before it stops asking for steps (it is still
# stepped while another sequence asks: a batch steps all its sequences).
LOOKAHEAD = 2

END = object()  # a generation's end, in its outbox


@dataclass(eq=False)
class Generation:
    """One generation as the decoding thread holds it."""

    prompt: list[int]
    decoding: Decoding
    max_new: int  # what the request and the context leave room for
    outbox: queue.SimpleQueue[object] = field(default_factory=queue.SimpleQueue)
    given: int = 0  # tokens put in the outbox
    taken: int = 0  # tokens the consumer took
    finished: bool = False  # nothing more to decode
    released: bool = False  # the consumer is gone

    def wants(self) -> bool:
        return not (self.finished or self.released) and self.given - self.taken < LOOKAHEAD

    def put(self, item: Token | PromptScores | PromptCached) -> None:
        if isinstance(item, Token):
            self.given += 1
        self.outbox.put(item)

    def end(self, item: object = END) -> None:
        """No more to decode; ``item``: the generation's end, or the exception it raises."""
        self.finished = True
        self.outbox.put(item)


G = TypeVar("G", bound=Generation)


def max_new(prompt: list[int], decoding: Decoding, n_ctx: int) -> int:
    """Tokens a generation may make: what the request and the context leave room for."""
    room = n_ctx - len(prompt)
    asked = decoding.params.max_tokens
    return room if asked is None else min(asked, room)


Item = Token | PromptScores | PromptCached


def taken_from(
    outbox: queue.SimpleQueue[object],
    cond: threading.Condition,
    took: Callable[[], None],
    left: Callable[[], None],
) -> Generator[Item]:
    """The consumer's side of a generation a decoding thread puts into ``outbox`` (items, then
    ``END`` or the exception it ends with), on the consumer's thread: ``took`` after each token
    it took and ``left`` once it is gone (done, or stopped taking), both under ``cond``, which
    is notified, so that the decoding thread steps on, or frees the slot."""
    try:
        while True:
            item = outbox.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, Token | PromptScores | PromptCached)
            yield item
            if isinstance(item, Token):
                with cond:
                    took()
                    cond.notify()
    finally:
        with cond:
            left()
            cond.notify()


class DecodingThread(ABC, Generic[G]):
    """Serves up to ``slots`` generations at once on a thread of its own. A subclass admits a
    generation (``_admit``), forgets one that ended (``_forget``), and computes a step for the
    active ones (``_step``); ``_discard`` frees what it holds when the thread is parked."""

    def __init__(self, slots: int, name: str) -> None:
        self.slots = slots
        self._cond = threading.Condition()
        self._waiting: list[G] = []  # admitted in this order as slots free up
        self._active: list[G] = []  # admitted, in admission order
        self._closed = False
        self._closed_with: Exception = RuntimeError("the engine was closed")
        self._parked = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalizes: a thread that returns from an MLX call
        # then is ended inside it, and the C++ unwinding aborts the process.
        atexit.register(self.close)

    def close(self) -> None:
        """Fail the generations in flight and park the decoding thread. It never ends: the
        thread-local state MLX keeps for it (mx.compile's cache) is freed at a thread's end,
        and where that is during the interpreter's finalization (a thread ending is still
        running its thread-local destructors after ``join``) the process aborts."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._parked.wait(timeout=60)
        atexit.unregister(self.close)

    @property
    def busy(self) -> int:
        """Generations admitted or waiting for a slot."""
        with self._cond:
            return len(self._active) + len(self._waiting)

    def _stream(self, gen: G) -> Generator[Token | PromptScores | PromptCached]:
        """The consumer's side: nothing is admitted before the first ``next()``."""
        with self._cond:
            if self._closed:
                raise self._closed_with
            self._waiting.append(gen)
            self._cond.notify()

        def took() -> None:
            gen.taken += 1

        def left() -> None:
            gen.released = True

        yield from taken_from(gen.outbox, self._cond, took, left)

    # --- the decoding thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # what is in flight fails, and the engine serves no more
            if not self._is_fatal(exc):
                log.exception("the decoding thread failed")
            with self._cond:
                self._closed = True
                # Without its traceback: its frames would keep what the engine holds alive.
                self._closed_with = exc.with_traceback(None)
        with self._cond:
            for gen in self._active + self._waiting:
                gen.end(self._closed_with)
            self._active, self._waiting = [], []
            try:
                self._discard()
            except Exception:
                log.exception("freeing the engine's state failed")
        self._parked.set()
        # Parked for good (see ``close``), on an event nobody sets: a thread woken while the
        # interpreter finalizes is ended then, inside MLX's thread-local destructors.
        threading.Event().wait()

    def _is_fatal(self, exc: Exception) -> bool:
        """An exception that ends the engine as expected (it is not logged as a bug)."""
        return False

    def _loop(self) -> None:
        """Until the engine is closed."""
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    self._settle()
                    if any(g.wants() for g in self._active):
                        break
                    self._cond.wait()
            self._step()

    def _settle(self) -> None:
        """Between steps: drop ended or released generations, admit waiting ones. One whose
        task was told to stop (``Decoding.stop_asked``) ends here: its consumer, waiting for
        a first token while the prompt is prefilled, cannot leave, and a long prompt would keep
        its slot to the end of its prefill; this way it stops within one chunk."""
        for gen in [*self._active, *self._waiting]:
            if not gen.finished and gen.given == 0 and gen.decoding.stop_asked():
                gen.end()
        self._waiting = [g for g in self._waiting if not g.finished]
        for gen in [g for g in self._active if g.released or g.finished]:
            self._active.remove(gen)
            self._forget(gen)
        self._waiting = [g for g in self._waiting if not g.released]
        while self._waiting and len(self._active) < self.slots:
            gen = self._waiting.pop(0)
            if gen.max_new <= 0 and not gen.decoding.echo:
                gen.end()  # nothing to generate
                continue
            try:
                self._admit(gen)
            except Exception as exc:
                gen.end(exc)
                if self._is_fatal(exc):
                    raise
                continue
            self._active.append(gen)

    @abstractmethod
    def _admit(self, gen: G) -> None:
        """Take ``gen`` into the batch; an exception fails it alone."""

    @abstractmethod
    def _forget(self, gen: G) -> None:
        """``gen`` ended or its consumer left: free what it holds."""

    @abstractmethod
    def _step(self) -> None:
        """One step for the active generations (called without the lock)."""

    def _discard(self) -> None:
        """The thread is parked: free the engine's state (on this thread)."""
