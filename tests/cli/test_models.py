"""Which worker's cache `shoal models add` links a model's files into."""

from pathlib import Path

import pytest

from cli import models
from services.worker.identity import node_id


@pytest.fixture
def no_default_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "default_data_dir", lambda: tmp_path / "default")


@pytest.mark.usefixtures("no_default_worker")
def test_a_workers_own_cache_is_its_data_dirs(tmp_path: Path) -> None:
    node_id(tmp_path / "node")
    cache = models.worker_cache(tmp_path / "node" / "models")
    assert cache is not None and cache.root == tmp_path / "node" / "models"


@pytest.mark.usefixtures("no_default_worker")
def test_shoal_ups_data_dir_finds_the_cache_of_its_worker(tmp_path: Path) -> None:
    # `shoal up --data-dir data` keeps its worker's data in data/worker: a model added with
    # --cache-dir data/models is linked where that worker's runners look, not hashed again.
    node_id(tmp_path / "data" / "worker")
    cache = models.worker_cache(tmp_path / "data" / "models")
    assert cache is not None and cache.root == tmp_path / "data" / "worker" / "models"


@pytest.mark.usefixtures("no_default_worker")
def test_no_worker_has_run_here(tmp_path: Path) -> None:
    assert models.worker_cache(tmp_path / "data" / "models") is None
