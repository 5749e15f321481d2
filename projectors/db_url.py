"""A database URL as a Shoal process keeps it: a SQLite file's path made absolute where it
enters. Plain string work, no database driver: every `shoal` command's options go through it."""

from __future__ import annotations

import re
from pathlib import Path

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
