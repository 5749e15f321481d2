"""A recycled runner process loads one model after another: what each leaves behind is given
back, so that the process does not grow with every load. A process that collects rarely
collects everything now and then."""

import gc

import psutil

from harness.models.templated import SMOLLM2
from inference.engines.llamacpp.engine import LlamaCppEngine
from process.memory import Collector, give_back


def test_loading_and_unloading_again_and_again_keeps_the_process_flat() -> None:
    rss = []
    for _ in range(4):
        engine = LlamaCppEngine(SMOLLM2, n_ctx=2048, slots=2, n_threads=1)
        engine.load()
        engine.unload()
        del engine
        give_back()
        rss.append(psutil.Process().memory_info().rss)
    # Without give_back, each load left about 20 MiB behind in glibc's heap.
    assert rss[-1] - rss[0] < 8 * 2**20, [r >> 20 for r in rss]


def test_a_collector_collects_what_rare_collections_leave_now_and_then() -> None:
    now = [0.0]
    collector = Collector(every_s=60.0, clock=lambda: now[0])

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    gc.disable()  # as good as tune_gc's thresholds for a while
    try:
        for _ in range(1000):
            Cycle()
        now[0] = 59.0
        assert not collector.maybe()
        assert _count(Cycle) == 1000
        now[0] = 60.0
        assert collector.maybe()
        assert _count(Cycle) == 0
        assert not collector.maybe()  # the next one a minute on
        now[0] = 120.0
        assert collector.maybe()
    finally:
        gc.enable()


def _count(kind: type) -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, kind))
