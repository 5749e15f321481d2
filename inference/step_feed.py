"""Steps from the engine's thread to the runner's event loop, in groups.

The engine runs in a thread of its own: between two tokens it only samples and decodes text,
and it never waits for the event loop. Each token's step goes on the feed with the time it was
made; the loop is woken for the first step, for the last, and otherwise at most every
``window_s``, and then takes every step made so far. Publishing those as chunks happens on the
loop, while the engine computes the next token.

Why: run on the loop, each token paid for a turn of the loop and its own chunk event in the
pause between two forward passes, when llama.cpp's caches have just been flushed and its other
threads spin idle: that pause grew to several times the in-process one (docs/runners.md).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from inference.generation import ScoredPrompt, Step

# At most this long the engine's thread waits for the loop to take the first token.
FIRST_WAIT_S = 1.0


@dataclass(frozen=True)
class Made:
    """A step, with when it was made: ``at`` from ``time.perf_counter()``, ``ts`` from
    ``time.time()``."""

    step: Step | ScoredPrompt
    at: float
    ts: float


class StepFeed:
    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self._loop = loop
        self._window_s = window_s
        self._lock = threading.Lock()
        self._made: list[Made] = []
        self._closed = False
        self._woken_at: float | None = None
        self._ready = asyncio.Event()
        self._first_taken = threading.Event()

    def put(self, step: Step | ScoredPrompt) -> None:
        """From the engine's thread."""
        now = time.perf_counter()
        with self._lock:
            self._made.append(Made(step, now, time.time()))
        last = self._woken_at
        final = isinstance(step, Step) and step.token_id is None
        if final or last is None or now - last >= self._window_s:
            self._woken_at = now
            self._loop.call_soon_threadsafe(self._ready.set)
        if last is None and not final:
            # The first token waits until the loop has it: with every core busy computing the
            # next one, the loop's thread could wait milliseconds for one. (A last step has
            # nothing after it to wait for, and may be put from the loop's own thread.)
            self._first_taken.wait(FIRST_WAIT_S)

    def close(self) -> None:
        """From the engine's thread, when it is done (or failed): the loop takes what is left."""
        with self._lock:
            self._closed = True
        self._loop.call_soon_threadsafe(self._ready.set)

    async def next_group(self) -> list[Made] | None:
        """The steps made since the last call, once the engine's thread says so; None once it
        has closed the feed and every step was taken."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._lock:
                made, self._made = self._made, []
                closed = self._closed
            self._first_taken.set()
            if closed:
                self._ready.set()  # the next call returns at once
            if made:
                return made
            if closed:
                return None
