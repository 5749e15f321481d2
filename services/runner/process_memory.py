"""What a runner process gives back between two runners (a recycled process, ``shoal runner``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from functools import cache


def give_back() -> None:
    """Collect the unloaded runner's garbage, then hand glibc's free heap back to the system:
    glibc keeps what llama.cpp freed for its next allocations, and a process that loaded one
    model after another grew with each (tests/services/runner/test_process_memory.py)."""
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
