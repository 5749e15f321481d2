"""CPU use read from /proc: a process's, a process tree's, the whole machine's, and how many
cores everything else used over a stretch of a benchmark (on a shared machine, the main noise).
Where there is no /proc every figure is 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # clock ticks a second
QUIET = 0.1  # cores used by other processes below which a run counts as undisturbed


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:  # a process that just exited, or no /proc
        return ""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first."""
    out: list[int] = []
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir) if os.path.isdir(task_dir) else []:
        for child in read(f"{task_dir}/{tid}/children").split():
            out += [int(child), *descendants(int(child))]
    return out


def named(pid: int) -> str:
    """The process's command name (``comm``)."""
    return read(f"/proc/{pid}/comm").strip()


def arguments(pid: int) -> list[str]:
    """The process's command line."""
    return read(f"/proc/{pid}/cmdline").split("\0")


def process_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (every thread), in clock ticks (0 if it is gone)."""
    stat = read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return int(stat[11]) + int(stat[12]) if len(stat) > 12 else 0


def tree_ticks(pid: int) -> int:
    """``process_ticks`` of ``pid`` and every process below it."""
    return sum(process_ticks(p) for p in [pid, *descendants(pid)])


def machine_busy_ticks() -> int:
    """Ticks the whole machine was busy (steal included: time given to someone else)."""
    fields = read("/proc/stat").split("\n", 1)[0].split()[1:9]
    if len(fields) < 8:
        return 0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return user + nice + system + irq + softirq + steal


class CpuWatch:
    """CPU used over a stretch of a benchmark: by each of its own parts (``parts`` gives the
    clock ticks each has used so far), and by every other process on the machine, in cores
    (their busy time over the wall time)."""

    def __init__(self, parts: Callable[[], dict[str, int]]) -> None:
        self._parts = parts
        self._t = time.perf_counter()
        self._busy = machine_busy_ticks()
        self._start = parts()

    def stop(self) -> tuple[dict[str, float], float]:
        """(CPU seconds per part, cores used by other processes) since the watch began."""
        elapsed = time.perf_counter() - self._t
        busy = machine_busy_ticks() - self._busy
        now = self._parts()
        used = {k: (now[k] - self._start[k]) / HZ for k in now}
        other = busy / HZ - sum(used.values())
        return used, max(0.0, other / elapsed) if elapsed > 0 else 0.0

    def other_cores(self) -> float:
        return self.stop()[1]
