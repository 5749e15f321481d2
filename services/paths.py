"""Paths as a Shoal process keeps them: absolute, made so where they enter. Where its files go
when it is told nothing (``SHOAL_DATA_DIR``, else ``~/.shoal``), and a database URL's file.

Plain string work, no database driver: every `shoal` command's options go through it."""

from __future__ import annotations

import os
import re
from pathlib import Path


def default_data_dir() -> Path:
    return Path(os.environ.get("SHOAL_DATA_DIR", Path.home() / ".shoal")).expanduser().absolute()


# sqlite:///PATH or sqlite+driver:///PATH, a ?query after the path.
_SQLITE = re.compile(r"^(sqlite(?:\+\w+)?:///)([^?]*)(.*)$", re.DOTALL)


def absolute_db_url(url: str) -> str:
    """``url`` with a SQLite file's relative path made absolute against the current directory
    (``sqlite:///shoal.db`` names a file where the command was typed, whichever process opens
    it later); any other URL, an in-memory database or an absolute path, as it is."""
    match = _SQLITE.match(url)
    if match is None:
        return url
    scheme, path, rest = match.groups()
    if path in ("", ":memory:") or path.startswith("file:") or Path(path).is_absolute():
        return url
    return f"{scheme}{Path(path).expanduser().absolute()}{rest}"
