"""Where a Shoal process keeps its files when it is told nothing: ``SHOAL_DATA_DIR``, else
``~/.shoal``, made absolute where it enters."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    return Path(os.environ.get("SHOAL_DATA_DIR", Path.home() / ".shoal")).expanduser().absolute()
