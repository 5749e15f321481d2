"""Models the tests make from the packaged ones (SmolLM2 in MLX, SmolLM2 with another chat
template: seconds of CPU and hundreds of MB each), kept on disk across xdist workers and runs.

Each is named after the digest of what makes it (the input file, the converter's code and
package versions, the template), so that a change to any of them makes a new one; it is made
once under a file lock (the other workers wait for it, then read it) and moved into place whole.
Those not used for ``KEEP_DAYS`` are removed when a new one is made: the cache holds what the
tests now ask for, not every template they ever had."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

KEEP_DAYS = 7


def cache_dir() -> Path:
    """``$SHOAL_TEST_CACHE``, else shoal/test-models under the user's cache directory."""
    if named := os.environ.get("SHOAL_TEST_CACHE"):
        return Path(named)
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "shoal" / "test-models"


@functools.cache
def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def packages(*names: str) -> str:
    return " ".join(f"{name}=={version(name)}" for name in names)


@contextmanager
def _locked(path: Path, *, wait: bool = True) -> Iterator[bool]:
    with path.with_name(path.name + ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prune(folder: Path, keep: Path) -> None:
    """Removes the entries not used for KEEP_DAYS (one that another process holds is left)."""
    old = time.time() - KEEP_DAYS * 86400
    for entry in folder.iterdir():
        if entry == keep or entry.suffix in (".lock", ".part") or entry.lstat().st_mtime > old:
            continue
        with _locked(entry, wait=False) as mine:
            if mine:
                _remove(entry)
                entry.with_name(entry.name + ".lock").unlink(missing_ok=True)


def cached(name: str, make: Callable[[Path], object]) -> Path:
    """The cache's ``name`` (a file or a folder), made by ``make(path)`` where it is not yet."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with _locked(path):
        if not path.exists():
            part = path.with_name(path.name + ".part")
            _remove(part)  # a make that was killed
            make(part)
            part.rename(path)
            _prune(folder, path)
        os.utime(path)  # used now: not pruned
    return path
