"""A process's memory watched while a block runs, for the tests and benchmarks that show a
refusal or a load leaves it flat."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRss:
    """The largest resident memory of a process while the block runs, sampled every 5 ms
    (``before``: as the block began)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def __str__(self) -> str:
        return f"RSS {self.before / 2**20:.0f} -> peak {self.peak / 2**20:.0f} MiB"
