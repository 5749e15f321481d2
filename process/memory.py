"""What a long-running process hands back to the system after a burst of allocations: a runner
process between two runners (``shoal runner``), a projector after a snapshot, a projector and a
planner now and then (``Collector``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable
from functools import cache

# How often a Collector collects everything.
COLLECT_EVERY_S = 60.0


def give_back() -> None:
    """Collect the garbage, then hand glibc's free heap back to the system: glibc keeps what
    was freed for its next allocations, so a process's size stays at its peak. A process that
    loaded one model after another grew with each (tests/process/test_memory.py);
    a projector kept a snapshot's peak (bench/soak.py)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: macOS, musl)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] | None = getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None
    return trim


class Collector:
    """``give_back`` at most once every ``every_s`` seconds, for a process whose collector
    ``tune_gc`` made rare. Its young collections free the cycles made since the last one, but a
    cycle still in use at one of them (a round's SQL statement, a batch's rows) moves to the
    oldest generation, which those thresholds collect after hours: a planner grew by its
    statements' parameters for as long as it ran (bench/soak.py)."""

    def __init__(
        self, every_s: float = COLLECT_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last = clock()

    def maybe(self) -> bool:
        """Collect and give back if ``every_s`` has passed since the last time; whether it
        did."""
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        give_back()
        return True


# The process's own: in `shoal up` the projector and the planner share one process, and one
# full collection a minute serves both.
EVERY_MINUTE = Collector()
