"""The figures and tables of a benchmark's report."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
from collections.abc import Iterable


def med(values: Iterable[float]) -> float:
    """The median, 0 when there is nothing."""
    items = list(values)
    return statistics.median(items) if items else 0.0


def iqr(values: list[float], fmt: str) -> str:
    """The middle half of ``values`` (paired figures scatter a lot on a busy machine)."""
    if len(values) < 4:
        return ""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"middle half {fmt.format(q1)} .. {fmt.format(q3)}"


def verdict(ok: bool) -> str:
    """A target met or missed, as the tables say it."""
    return "ok" if ok else "MISSED"


def print_head(head: str, *under: str, rule: int = 0) -> None:
    """A table's column names (``head``, then the lines ``under`` it) and a rule as wide as
    ``head``, plus ``rule`` characters."""
    print(head)
    for line in under:
        print(line)
    print("-" * (len(head) + rule))


def print_profile(profiler: cProfile.Profile, title: str, top: int) -> None:
    """The ``top`` functions of a profile, by cumulative time and by own time."""
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        print(f"\n--- cProfile, {title}, sorted by {key} ---")
        text = out.getvalue()
        start = text.find("   ncalls")
        print(text[start:].rstrip() if start >= 0 else text)
