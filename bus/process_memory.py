"""What a long-running process hands back to the system after a burst of allocations: a runner
process between two runners (``shoal runner``), a projector after a snapshot."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from functools import cache


def give_back() -> None:
    """Collect the garbage, then hand glibc's free heap back to the system: glibc keeps what
    was freed for its next allocations, so a process's size stays at its peak. A process that
    loaded one model after another grew with each (tests/bus/test_process_memory.py);
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
