"""Paths a user gives are made absolute where they enter, so that whatever stores them, links to
them or hands them to another process means the same file wherever that one runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from cli.options import DbUrl, absolute
from events.catalogue import WeightFile
from projectors.db_url import absolute_db_url
from services.models.weights_cache import WeightsCache, sha256_of


def test_a_relative_sqlite_file_is_made_absolute_and_other_urls_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert absolute_db_url("sqlite:///shoal.db") == f"sqlite:///{tmp_path}/shoal.db"
    assert absolute_db_url("sqlite:///data/x.db") == f"sqlite:///{tmp_path}/data/x.db"
    assert absolute_db_url("sqlite+aiosqlite:///x.db").endswith(f"{tmp_path}/x.db")
    for unchanged in (
        "sqlite:////abs/x.db",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql://postgres@127.0.0.1:5432/test",
    ):
        assert absolute_db_url(unchanged) == unchanged


def test_options_and_their_environment_variables_arrive_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    seen: dict[str, object] = {}
    app = typer.Typer()

    @app.command()
    def command(
        db: DbUrl = "sqlite:///default.db",
        data_dir: Annotated[Path, typer.Option(callback=absolute)] = Path("data"),
    ) -> None:
        seen.update(db=db, data_dir=data_dir)

    assert CliRunner().invoke(app, []).exit_code == 0
    assert seen == {"db": f"sqlite:///{tmp_path}/default.db", "data_dir": tmp_path / "data"}
    result = CliRunner().invoke(app, ["--data-dir", "d"], env={"SHOAL_DB_URL": "sqlite:///e.db"})
    assert result.exit_code == 0
    assert seen == {"db": f"sqlite:///{tmp_path}/e.db", "data_dir": tmp_path / "d"}


def test_a_cache_named_relatively_links_to_its_blobs_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    src = Path("model.gguf")
    src.write_bytes(os.urandom(1000))
    sha = sha256_of(src)
    f = WeightFile(name="model.gguf", object=f"sha256/{sha}", size=1000, sha256=sha)
    cache = WeightsCache(Path("data/worker/models"))
    cache.adopt(src, f)
    directory = cache.link("m", [f])
    monkeypatch.chdir("/")  # another process, another cwd
    assert (tmp_path / directory.relative_to(tmp_path) / "model.gguf").read_bytes() == (
        tmp_path / "model.gguf"
    ).read_bytes()
    assert directory.is_absolute()
