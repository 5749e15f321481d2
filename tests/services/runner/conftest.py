"""SmolLM2 copies with another chat template, each written once (a copy of the whole file:
seconds of CPU each) into the tests' model cache, which the xdist workers and later runs share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.model_cache import cached, digest, file_digest, packages
from tests.templated import SMOLLM2, write_gguf_with_template

__all__ = ["SMOLLM2", "WithTemplate", "smollm2_with_template"]

WithTemplate = Callable[[str], Path]


def with_template(template: str) -> Path:
    key = digest(file_digest(SMOLLM2), template, packages("gguf"))
    return cached(f"smollm2-{key}.gguf", lambda out: write_gguf_with_template(template, out))


@pytest.fixture(scope="session")
def smollm2_with_template() -> WithTemplate:
    """SmolLM2 whose GGUF metadata carries ``template`` as its chat template."""
    return with_template
