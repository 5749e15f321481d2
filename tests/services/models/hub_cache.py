"""A Hugging Face cache laid out as ``huggingface_hub`` lays it out, written by hand: what a
machine has after downloading from the Hub, for the tests that have no network.

    <cache>/models--<org>--<name>/blobs/<sha256>
    <cache>/models--<org>--<name>/refs/main                     the commit
    <cache>/models--<org>--<name>/snapshots/<commit>/<file>     a link to its blob
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """Put ``files`` (name in the repository -> a file here) into the cache as ``repo``'s;
    the snapshot's directory."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
