"""A node's cache of weight files, by SHA-256: what it fetched from the models bucket or found
on its own disk, kept once however many models use it.

    <models dir>/blobs/<sha256>            the file, or a link to the same bytes elsewhere on
                                           this machine (a package's file, a --path file)
    <models dir>/blobs/<sha256>.partial    a fetch under way (.resume: where it got to)
    <models dir>/shared/<model>/<name>     a model's directory: links to its blobs under the
                                           names its engine looks for (the parts of a split
                                           GGUF side by side, an MLX directory)

A blob is only ever a file whose digest was checked (fetched and verified, or hashed), so a
blob of the right size is taken as it is: re-hashing gigabytes at every runner start would
cost seconds. A link whose target went away, or changed size, is no blob: it is fetched again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from bus.events import WeightFile
from bus.subjects import escape_token

_HASH_BLOCK = 8 * 1024 * 1024


def sha256_of(path: Path) -> str:
    """The file's SHA-256, hex (blocking: run it in a thread)."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            sha.update(block)
    return sha.hexdigest()


class WeightsCache:
    def __init__(self, models_dir: Path) -> None:
        # Absolute: a link's target is read from the link's own directory, so a blob named
        # relatively (a cache given as `data/models`) would point nowhere.
        self.root = Path(models_dir).absolute()
        self.blobs = self.root / "blobs"

    def blob(self, sha256: str) -> Path:
        return self.blobs / sha256

    def holds(self, f: WeightFile) -> bool:
        """Whether the file is here (its blob, or what the blob links to, of its size)."""
        try:
            return self.blob(f.sha256).stat().st_size == f.size
        except OSError:
            return False

    def adopt(self, path: Path, f: WeightFile) -> None:
        """Take a file on this machine known to hold ``f``'s bytes (hashed by the caller) as
        its blob, by a link: no copy of what is on this disk already."""
        self.blobs.mkdir(parents=True, exist_ok=True)
        blob = self.blob(f.sha256)
        tmp = blob.with_name(f".{blob.name}.{os.getpid()}.link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(path).resolve())
        tmp.replace(blob)

    def model_dir(self, model_id: str) -> Path:
        return self.root / "shared" / escape_token(model_id)

    def link(self, model_id: str, files: list[WeightFile]) -> Path:
        """The model's directory, with a link to the blob of each of ``files`` under its name
        (the others a shard does not need are simply absent)."""
        directory = self.model_dir(model_id)
        for f in files:
            name = Path(f.name)
            if name.is_absolute() or ".." in name.parts:
                raise ValueError(f"model {model_id}: file name {f.name!r} leaves its directory")
            target = directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            blob = self.blob(f.sha256)
            if target.is_symlink() and target.readlink() == blob:
                continue
            tmp = target.with_name(f".{target.name}.{os.getpid()}.link")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(blob)
            tmp.replace(target)
        return directory

    @contextlib.asynccontextmanager
    async def lock(self, sha256: str) -> AsyncIterator[None]:
        """Held while a blob is fetched: a second runner of this node that needs the same file
        waits, then finds it here, rather than fetching it a second time."""
        self.blobs.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.blobs / f"{sha256}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing lets go of the lock
