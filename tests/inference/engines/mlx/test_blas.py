"""Which BLAS MLX multiplies with (inference/engines/mlx/blas.py), in fresh processes: the
choice must be made before mlx is imported, which only a new process shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inference.engines.mlx.blas import ENV, OPENBLAS, REFERENCE, use_openblas

# Imports an MLX engine module as the runner does, multiplies two float32 matrices, and says
# which libraries the process mapped and how far the product is from numpy's.
PROBE = """
import json, numpy as np
import inference.engines.mlx.engine
import mlx.core as mx
from inference.engines.mlx.blas import blas_in_use
rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 576), np.float32), rng.standard_normal((576, 96), np.float32)
error = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a @ b).max())
maps = open("/proc/self/maps").read()
print(json.dumps({"openblas": "libopenblas" in maps, "in_use": blas_in_use(), "error": error}))
"""


def _probe(**env: str) -> dict[str, object]:
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, object] = json.loads(run.stdout.splitlines()[-1])
    return result


needs_openblas = pytest.mark.skipif(
    use_openblas() is None, reason=f"{OPENBLAS} is not installed (make test installs it)"
)


@needs_openblas
def test_an_mlx_engine_multiplies_with_openblas_and_gets_numpys_product() -> None:
    seen = _probe()
    assert seen["openblas"] is True
    assert OPENBLAS in str(seen["in_use"])
    assert isinstance(seen["error"], float) and seen["error"] < 1e-3


def test_the_wheels_own_blas_can_be_kept() -> None:
    seen = _probe(**{ENV: REFERENCE})
    assert seen["openblas"] is False
    assert seen["in_use"] == "the mlx wheel's own"
    assert isinstance(seen["error"], float) and seen["error"] < 1e-3


def test_a_library_that_cannot_be_loaded_leaves_mlx_its_own() -> None:
    seen = _probe(**{ENV: "libno-such-blas.so.9"})
    assert seen["openblas"] is False
    assert seen["in_use"] == "the mlx wheel's own"


def test_too_late_once_mlx_is_imported() -> None:
    """mlx imported first (a model conversion, say): the wheel's scope is fixed, so nothing is
    loaded rather than a library MLX would not use."""
    code = (
        "import mlx.core, json\n"
        "from inference.engines.mlx.blas import blas_in_use\n"
        "print(json.dumps(blas_in_use()))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(run.stdout.splitlines()[-1]) == "the mlx wheel's own"
    assert "mlx was imported before" in run.stderr
