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

A model's directory's mtime is when a runner of this node last used it (``link`` touches
it): what the cache's budget evicts by (``cache_budget.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import stat
from collections.abc import AsyncIterator
from pathlib import Path

from events.catalogue import WeightFile
from events.subjects import escape_token, unescape_token
from services.models.cache_budget import CachedModel

_HASH_BLOCK = 8 * 1024 * 1024
_BLOB_NAME = re.compile(r"^[0-9a-f]{64}$")


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

    @property
    def shared(self) -> Path:
        return self.root / "shared"

    def model_dir(self, model_id: str) -> Path:
        return self.shared / escape_token(model_id)

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
        self.touch(model_id)
        return directory

    def touch(self, model_id: str) -> None:
        """Note that a runner of this node uses the model now (its directory's mtime; a model
        without one here holds nothing to evict)."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.model_dir(model_id))

    # --- what the cache holds, and letting go of it (blocking: run them in a thread) -------

    def blob_costs(self) -> dict[str, int]:
        """Every blob (by SHA-256) and the bytes it takes on this disk: a file's size, nothing
        for a link to a file that was here already."""
        costs: dict[str, int] = {}
        try:
            entries = list(os.scandir(self.blobs))
        except FileNotFoundError:
            return costs
        for entry in entries:
            if not _BLOB_NAME.match(entry.name):
                continue  # a fetch under way, its resume note, a lock
            try:
                cost = 0 if entry.is_symlink() else entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            costs[entry.name] = cost
        return costs

    def models(self) -> list[CachedModel]:
        """Each model's directory: the blobs it links to and when it was last used."""
        out: list[CachedModel] = []
        try:
            directories = [d for d in self.shared.iterdir() if d.is_dir()]
        except FileNotFoundError:
            return out
        for directory in directories:
            blobs = set()
            for path in directory.rglob("*"):
                if path.is_symlink() and (target := path.readlink()).parent == self.blobs:
                    blobs.add(target.name)
            try:
                last_used = directory.stat().st_mtime
            except FileNotFoundError:
                continue
            out.append(CachedModel(unescape_token(directory.name), frozenset(blobs), last_used))
        return out

    def drop_model(self, model_id: str) -> None:
        """Remove the model's directory (links only: the blobs are left to ``drop_blob``)."""
        shutil.rmtree(self.model_dir(model_id), ignore_errors=True)

    def drop_blob(self, sha256: str, made_before: float | None = None) -> int:
        """Delete a blob: a copy, or only the link to a file that was on this machine (that
        file is never touched). One made at or after ``made_before`` (seconds since the epoch)
        is kept. Returns the bytes freed."""
        blob = self.blob(sha256)
        try:
            st = blob.lstat()
        except FileNotFoundError:
            return 0
        if made_before is not None and st.st_mtime >= made_before:
            return 0
        blob.unlink(missing_ok=True)
        return 0 if stat.S_ISLNK(st.st_mode) else st.st_size

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
