"""The tests' model cache (harness/models/cache.py): one make for concurrent askers, nothing half
made in place, what is unused for long removed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from harness.models.cache import KEEP_DAYS, cached


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHOAL_TEST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_askers_at_once_share_one_make(cache: Path) -> None:
    made: list[Path] = []

    def make(out: Path) -> None:
        made.append(out)
        time.sleep(0.2)  # the others ask meanwhile
        out.mkdir()
        (out / "weights").write_text("w")

    got: list[Path] = []
    askers = [threading.Thread(target=lambda: got.append(cached("m", make))) for _ in range(3)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert made == [cache / "m.part"]
    assert got == [cache / "m"] * 3 and (cache / "m" / "weights").read_text() == "w"


def test_a_failed_make_leaves_nothing_and_the_next_makes_it_whole(cache: Path) -> None:
    def failing(out: Path) -> None:
        out.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cached("f", failing)
    assert not (cache / "f").exists()
    assert cached("f", lambda out: out.write_text("whole")).read_text() == "whole"


def test_entries_unused_for_long_go_when_a_new_one_is_made(cache: Path) -> None:
    old, used = cached("old", lambda p: p.write_text("o")), cached("used", lambda p: p.mkdir())
    long_ago = time.time() - (KEEP_DAYS + 1) * 86400
    for path in (old, used):
        os.utime(path, (long_ago, long_ago))
    assert cached("used", lambda p: p.mkdir()) == used  # used again: kept
    cached("new", lambda p: p.write_text("n"))
    assert sorted(p.name for p in cache.iterdir() if p.suffix != ".lock") == ["new", "used"]
