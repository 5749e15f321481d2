"""The tiny random-weight diffusers pipeline (``harness/models/tiny_diffusion.py``), made once
and kept in the tests' model cache (named after the maker's code and the packages' versions)."""

from __future__ import annotations

from pathlib import Path

from harness.models import tiny_diffusion
from tests.model_cache import cached, digest, file_digest, packages


def tiny_diffusion_pipeline() -> Path:
    """Its directory: read only (a test that changes it copies it first)."""
    code = file_digest(Path(tiny_diffusion.__file__))
    using = packages("diffusers", "transformers", "torch", "safetensors")
    name = f"tiny-diffusion-{digest(code, using)}"
    return cached(name, tiny_diffusion.make_tiny_diffusion_pipeline)
