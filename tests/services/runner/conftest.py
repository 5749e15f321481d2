"""SmolLM2 copies with another chat template, each written once per session (a copy of the
whole file: seconds of CPU each)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.templated import SMOLLM2, gguf_with_template

__all__ = ["SMOLLM2", "WithTemplate", "smollm2_with_template"]

WithTemplate = Callable[[str], Path]


@pytest.fixture(scope="session")
def smollm2_with_template(tmp_path_factory: pytest.TempPathFactory) -> WithTemplate:
    """SmolLM2 whose GGUF metadata carries ``template`` as its chat template."""
    folder = tmp_path_factory.mktemp("templated")
    return lambda template: gguf_with_template(template, folder)
