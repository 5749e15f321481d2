"""A recycled runner process loads one model after another: what each leaves behind is given
back, so that the process does not grow with every load."""

import psutil

from bus.process_memory import give_back
from services.runner.engines.llamacpp.engine import LlamaCppEngine
from tests.templated import SMOLLM2


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
