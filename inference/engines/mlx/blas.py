"""OpenBLAS under MLX's CPU backend, where one is installed (Linux).

The mlx[cpu] wheel for Linux links the reference BLAS (netlib's), which multiplies float32
matrices at a few GFLOP/s: on a CPU a prompt's prefill and most of each token's time went
there. MLX calls ``cblas_sgemm`` through the wheel's ``libmlx.so``, which binds its symbols
lazily and searches the process's global scope before its own dependencies, so an OpenBLAS
loaded into the global scope *before mlx is imported* is the one MLX uses. After the import it
is too late (the wheel's lookup scope is fixed when it loads): this package's ``__init__``
loads it, so any import of an MLX engine module comes after, and so does the suite's
``tests/conftest.py``. ``bench/mlx_blas.py`` measures the difference.

``SHOAL_MLX_BLAS`` chooses: unset, OpenBLAS where the dynamic linker finds ``libopenblas.so.0``
(Debian and Ubuntu: ``apt install libopenblas0``); ``reference`` keeps the wheel's own; any
other value is the library to load (a path or a name).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

ENV = "SHOAL_MLX_BLAS"
OPENBLAS = "libopenblas.so.0"
REFERENCE = "reference"


@functools.cache
def use_openblas() -> ctypes.CDLL | None:
    """Load the BLAS that MLX is to use into the global scope (once); None where MLX keeps
    its own: not Linux, ``SHOAL_MLX_BLAS=reference``, none installed, or mlx already imported."""
    chosen = os.environ.get(ENV, OPENBLAS)
    if sys.platform != "linux" or chosen == REFERENCE:
        return None
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before %s could be loaded: it keeps its own BLAS", chosen)
        return None
    try:
        return ctypes.CDLL(chosen, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        if chosen != OPENBLAS:  # asked for by name: say that it is missing
            log.warning("%s=%s could not be loaded: MLX keeps its own BLAS", ENV, chosen)
        return None


def set_threads(n: int) -> None:
    """The threads OpenBLAS may use for one product (it takes every core by default)."""
    blas = use_openblas()
    setter = getattr(blas, "openblas_set_num_threads", None) if blas is not None else None
    if setter is not None:
        setter(ctypes.c_int(n))


def blas_in_use() -> str:
    """What MLX multiplies with here, for the runner's log and the benchmark."""
    blas = use_openblas()
    return blas._name if blas is not None else "the mlx wheel's own"
