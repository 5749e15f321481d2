"""The tiny random-weight diffusers pipeline (``harness/models/tiny_diffusion.py``), made once
and kept in the tests' model cache (named after the maker's code and the packages' versions)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

from harness.models import tiny_diffusion
from harness.models.cache import cached, digest, file_digest, packages


def tiny_diffusion_pipeline() -> Path:
    """Its directory: read only (a test that changes it copies it first)."""
    code = file_digest(Path(tiny_diffusion.__file__))
    using = packages("diffusers", "transformers", "torch", "safetensors")
    name = f"tiny-diffusion-{digest(code, using)}"
    return cached(name, tiny_diffusion.make_tiny_diffusion_pipeline)


_IN_PROCESS = """
import base64, json, sys
from events.records import ImageParams
from inference.engines.diffusion.engine import DiffusersEngine
asked = json.loads(sys.argv[1])
engine = DiffusersEngine(Path(asked.pop("path")), n_threads=asked.pop("threads"))
engine.load()
prompt = asked.pop("prompt")
made = engine.generate(prompt, ImageParams(**asked), lambda _p: None, lambda: False)
print(json.dumps([base64.b64encode(m.png).decode() for m in made]))
"""


def engine_pngs(prompt: str, threads: int = 1, **params: object) -> list[bytes]:
    """What the engine makes of ``prompt`` in a process of its own, as a runner's is: the
    tests' process has OpenBLAS loaded for MLX (``tests/conftest.py``), whose BLAS symbols
    PyTorch then calls, which changes the sums' order, so the images' last bits."""
    asked = {"path": str(tiny_diffusion_pipeline()), "threads": threads, "prompt": prompt}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path\n" + _IN_PROCESS,
            json.dumps(asked | params),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
        check=True,
    )
    return [base64.b64decode(p) for p in json.loads(done.stdout.splitlines()[-1])]
