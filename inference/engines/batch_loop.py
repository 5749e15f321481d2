"""The one batching loop every engine decodes on: llama.cpp's decoder, MLX's batch and its
one-slot loop, and an MLX ring's head.

Generations are admitted between steps, up to ``slots`` at once, in the order they came. A
thread of the loop's own is the only one that makes the engine's calls (llama.cpp's context,
mlx's per-thread streams, a pipeline's ring). Each generation hands its items to a ``Sink`` on
that thread: the runner's (``feed_sink.py``: its steps are made there, between two of the
engine's steps), or a Python generator's on the caller's thread (``pull``, for tests and
benchmarks). A sink that wants no more (a stop string, a cancel) frees the slot at the next
step.

What the loop does, the same for every engine: the waiting and active lists under one
condition; between steps (``_settle``) a generation whose task was told to stop while its
prompt is prefilled ends (``Decoding.stop_asked``: no token comes that a sink could refuse),
ended ones are forgotten, waiting ones admitted; a step runs for the generations that may go
on (``_step``); a generation pulled by a slow consumer is waited for a moment
(``straggler_s``) before a step leaves it out. What a step computes is the engine's: a
subclass admits a generation (``_admit``), forgets one (``_forget``) and steps the active
ones (``_step``): prefill a chunk, decode the batch, sample.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token

log = logging.getLogger(__name__)

Item = Token | PromptScores | PromptCached

END = object()  # a pulled generation's end, in its queue


def max_new(prompt: list[int], decoding: Decoding, n_ctx: int) -> int:
    """Tokens a generation may make: what the request and the context leave room for."""
    room = n_ctx - len(prompt)
    asked = decoding.params.max_tokens
    return room if asked is None else min(asked, room)


@dataclass(eq=False)
class Generation:
    """One generation as the loop holds it: what it decodes and where its items go."""

    prompt: list[int]
    decoding: Decoding
    max_new: int  # what the request and the context leave room for
    sink: Sink
    given: int = 0  # tokens handed to the sink
    finished: bool = False  # nothing more to decode; its sink was told
    released: bool = False  # a pulled generation's consumer is gone

    def prefilling(self) -> bool:
        """Its prompt is still run (no token made yet)."""
        return self.given == 0

    def live(self) -> bool:
        return not (self.finished or self.released)

    def runnable(self) -> bool:
        """Whether the next step may take it: its prompt is prefilled regardless of its sink,
        a token is made once the sink takes one."""
        return self.live() and (self.prefilling() or self.sink.ready())

    def behind(self) -> bool:
        """Decoding, its consumer not yet done with what it was given."""
        return self.live() and not self.prefilling() and not self.sink.ready()

    def emit(self, item: Item) -> bool:
        """Hand ``item`` over; False (and ended) when no more is wanted, or the sink failed."""
        if isinstance(item, Token):
            self.given += 1
        try:
            wanted = self.sink.take(item)
        except Exception as exc:  # the consumer's own error: this generation's alone
            self.end(exc)
            return False
        if not wanted:
            self.end()
        return wanted

    def end(self, error: BaseException | None = None) -> None:
        """No more to decode; ``error``: what the generation fails with. Once."""
        if not self.finished:
            self.finished = True
            self.sink.done(error)


G = TypeVar("G", bound=Generation)


class Pulled:
    """The sink of a generation pulled as a Python generator (``BatchLoop.pull``): its items
    queue up for the consumer, who takes them at its own pace, ``lookahead`` tokens ahead at
    most."""

    def __init__(self, lookahead: int) -> None:
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lookahead = lookahead
        self.given = 0  # tokens queued
        self.taken = 0  # tokens the consumer took
        self.released = False  # the consumer is gone

    def take(self, item: Item) -> bool:
        if self.released:
            return False
        self.queue.put(item)
        self.given += isinstance(item, Token)
        return True

    def done(self, error: BaseException | None) -> None:
        self.queue.put(error if error is not None else END)

    def ready(self) -> bool:
        return self.given - self.taken < self._lookahead


class BatchLoop(ABC, Generic[G]):
    """Serves up to ``slots`` generations at once on a thread of its own (see the module's
    doc). A subclass admits a generation (``_admit``: an exception fails it alone), forgets
    one that ended (``_forget``), and steps the runnable ones (``_step``: an exception that
    escapes it ends the loop, and what is in flight fails with it); ``_discard`` frees what it
    holds once the loop has ended."""

    # Tokens a pulled generation may be ahead of its consumer.
    lookahead: ClassVar[int] = 1
    # How long a step waits for consumers still taking their last token; 0: it does not.
    straggler_s: ClassVar[float] = 0.0
    # Whether the thread, once the loop ended, stays parked for good (rather than returning),
    # and the loop is closed before the interpreter finalizes (see ``close``).
    parks: ClassVar[bool] = False

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
        if self.parks:
            # Stopped before the interpreter finalizes: a thread that returns from an MLX call
            # then is ended inside it, and the C++ unwinding aborts the process.
            atexit.register(self.close)

    def close(self) -> None:
        """Fail the generations in flight and end the loop. A parking loop's thread never
        ends: the thread-local state MLX keeps for it (mx.compile's cache) is freed at a
        thread's end, and where that is during the interpreter's finalization (a thread
        ending is still running its thread-local destructors after ``join``) the process
        aborts."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._parked.wait(timeout=60)
        if self.parks:
            atexit.unregister(self.close)
        else:
            self._thread.join()

    @property
    def busy(self) -> int:
        """Generations admitted or waiting for a slot."""
        with self._cond:
            return len(self._active) + len(self._waiting)

    def push(self, gen: G) -> None:
        """Decode ``gen`` into its sink, from the first free slot."""
        with self._cond:
            if self._closed:
                raise self._closed_with
            self._waiting.append(gen)
            self._cond.notify()

    def pull(self, make: Callable[[Sink], G]) -> Generator[Item]:
        """The generation ``make`` makes for a sink, as a Python generator on the caller's
        thread: nothing is admitted before the first ``next()``, and a token is decoded once
        the consumer is less than ``lookahead`` behind. Once closed, the generation is out of
        the loop (what it held freed, a cache kept: the step under way is waited for)."""
        pulled = Pulled(self.lookahead)
        gen = make(pulled)
        self.push(gen)
        try:
            while True:
                item = pulled.queue.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, Token | PromptScores | PromptCached)
                yield item
                if isinstance(item, Token):
                    with self._cond:
                        pulled.taken += 1
                        self._cond.notify()
        finally:
            with self._cond:
                pulled.released = gen.released = True
                self._cond.notify_all()
                if threading.current_thread() is not self._thread:
                    while not self._closed and (gen in self._active or gen in self._waiting):
                        self._cond.wait()

    # --- the loop's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # what is in flight fails, and the engine serves no more
            if not self._is_fatal(exc):
                log.exception("the decoding thread failed")
            with self._cond:
                # Without its traceback: its frames would keep what the engine holds alive.
                self._closed_with = exc.with_traceback(None)
        with self._cond:
            self._closed = True
            for gen in self._active + self._waiting:
                gen.end(self._closed_with)
            self._active, self._waiting = [], []
            self._cond.notify_all()
            try:
                self._discard()
            except Exception:
                log.exception("freeing the engine's state failed")
        self._parked.set()
        if self.parks:
            # Parked for good (see ``close``), on an event nobody sets: a thread woken while
            # the interpreter finalizes is ended then, inside MLX's thread-local destructors.
            threading.Event().wait()

    def _is_fatal(self, exc: Exception) -> bool:
        """An exception that ends the engine as expected (it is not logged as a bug)."""
        return False

    def _loop(self) -> None:
        """Until the engine is closed."""
        while True:
            with self._cond:
                waited_from: float | None = None
                while True:
                    if self._closed:
                        return
                    self._settle()
                    ready = [g for g in self._active if g.runnable()]
                    if not (self.straggler_s and any(g.behind() for g in self._active)):
                        if ready:
                            break
                        self._cond.wait()
                        continue
                    now = time.monotonic()
                    waited_from = waited_from or now
                    if ready and now - waited_from >= self.straggler_s:
                        break
                    self._cond.wait(self.straggler_s)
            self._step(ready)

    def _settle(self) -> None:
        """Between steps: end the prefills of tasks told to stop (a long prompt would keep its
        slot, and the runner's shutdown, to the end of its prefill; this way it stops within
        one chunk), forget ended or released generations, admit waiting ones."""
        for gen in [*self._active, *self._waiting]:
            if not gen.finished and gen.prefilling() and gen.decoding.stop_asked():
                gen.end()
        waiting = [g for g in self._waiting if g.live()]
        ended = [g for g in self._active if not g.live()]
        if ended or len(waiting) < len(self._waiting):
            self._cond.notify_all()  # for consumers waiting until their generation is gone
        self._waiting = waiting
        for gen in ended:
            gen.end()  # a released one's sink is told too
            self._active.remove(gen)
            self._forget(gen)
        while self._waiting and len(self._active) < self.slots and self._room():
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

    def _room(self) -> bool:
        """Whether another generation may be admitted now (below ``slots``)."""
        return True

    @abstractmethod
    def _admit(self, gen: G) -> None:
        """Take ``gen`` into the batch; an exception fails it alone."""

    @abstractmethod
    def _forget(self, gen: G) -> None:
        """``gen`` ended or its consumer left: free what it holds."""

    @abstractmethod
    def _step(self, ready: list[G]) -> None:
        """One step for the runnable generations (called without the lock)."""

    def _discard(self) -> None:
        """The loop ended: free the engine's state (on this thread)."""
