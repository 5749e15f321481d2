"""The two built-in models' real weights, shared by the tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.models.catalogue import card_for
from services.models.resolve import resolve_model


@pytest.fixture(scope="session")
def models_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def smollm2_path(models_cache: Path) -> Path:
    return resolve_model(card_for("smollm2-135m"), models_cache)


@pytest.fixture(scope="session")
def gemma_path(models_cache: Path) -> Path:
    # Assembled once for the session (about a second, 250 MB in the temporary directory).
    return resolve_model(card_for("gemma3-270m"), models_cache)
