"""Fetching a file from a JetStream object store bucket (``bus/stores/object_store.py`` has the
layout and the put): a bounded window of chunks pulled, written and hashed in a thread, where it got
to noted beside the partial file, and resumed from there after an interruption. Never the
whole file in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectInfo
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict

from bus.leaderless import ask_again
from bus.stores.object_store import (
    CHUNK_BYTES,
    WRITE_BLOCK_BYTES,
    DigestMismatch,
    ObjectStoreError,
    Progress,
    digest_text,
    object_chunks_subject,
    object_stream,
)

log = logging.getLogger(__name__)

# A fetch has at most this much requested but not yet written: its memory, whatever the size.
FETCH_WINDOW_BYTES = 16 * 1024 * 1024
# A fetch notes where it got to (for a resume) after a sixteenth of the object, at most this
# many bytes: a resumed fetch fetches that much again at most, and each note is a file
# written and renamed (noted at every block, they took a large share of a fetch's time).
NOTE_EVERY_BYTES = 64 * 1024 * 1024
# A fetch that receives nothing for this long gives up (and resumes when run again).
STALL_S = 20.0


class ResumeNote(BaseModel):
    """Where an interrupted fetch got to, kept beside its partial file: the object it was
    fetching (nuid and digest), the bytes and chunks written, and the stream sequence of the
    last chunk they hold."""

    model_config = ConfigDict(frozen=True)

    nuid: str
    digest: str
    offset: int
    chunks: int
    seq: int


def resume_from(note: ResumeNote | None, info: ObjectInfo, partial_size: int) -> ResumeNote | None:
    """Pure: the note to resume from, or None to start over (no note, another object under
    that name since, or a partial file shorter than what the note says was written)."""
    if note is None or note.nuid != info.nuid or note.digest != info.digest:
        return None
    if note.offset > partial_size or note.offset > (info.size or 0):
        return None
    return note


def partial_paths(target: Path) -> tuple[Path, Path]:
    """The partial file a fetch into ``target`` writes, and its resume note."""
    return target.with_name(target.name + ".partial"), target.with_name(target.name + ".resume")


def _read_note(path: Path) -> ResumeNote | None:
    try:
        return ResumeNote.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def _write_note(path: Path, note: ResumeNote) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(note.model_dump_json())
    tmp.replace(path)


def hash_prefix(path: Path, size: int) -> Any:
    """SHA-256 of the first ``size`` bytes of ``path`` (a resumed fetch's hash so far)."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        left = size
        while left > 0:
            block = f.read(min(left, WRITE_BLOCK_BYTES))
            if not block:
                break
            sha.update(block)
            left -= len(block)
    return sha


@dataclass
class _Pulls:
    """The fetch's pull requests in flight, oldest first (the server serves them in order):
    how many chunks each still has to deliver."""

    open: deque[int] = field(default_factory=deque)

    @property
    def chunks(self) -> int:
        return sum(self.open)

    def delivered(self) -> None:
        if self.open:
            self.open[0] -= 1
            if self.open[0] <= 0:
                self.open.popleft()

    def ended(self) -> None:
        """The oldest request ended without delivering all it asked for."""
        if self.open:
            self.open.popleft()


async def fetch_file(
    js: JetStreamContext,
    bucket: str,
    info: ObjectInfo,
    target: Path,
    *,
    on_progress: Progress | None = None,
    window_bytes: int = FETCH_WINDOW_BYTES,
) -> Path:
    """Fetch object ``info`` into ``target``: written to ``target.partial`` as it arrives,
    renamed to ``target`` once its SHA-256 is the object's. An interrupted fetch resumes from
    its partial file; a damaged one (``DigestMismatch``) is removed. ``on_progress`` gets the
    bytes written so far, resumed ones included."""
    if info.digest is None or info.size is None:
        raise ObjectStoreError(f"object {info.name} in {bucket} has no digest or size")
    partial, note_path = partial_paths(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    note = resume_from(
        _read_note(note_path), info, partial.stat().st_size if partial.exists() else 0
    )
    if note is None:
        partial.write_bytes(b"")
        sha = hashlib.sha256()
        offset, chunks, seq = 0, 0, 0
    else:
        with partial.open("r+b") as f:
            f.truncate(note.offset)
        sha = await asyncio.to_thread(hash_prefix, partial, note.offset)
        offset, chunks, seq = note.offset, note.chunks, note.seq
        log.info("resuming %s at byte %d of %d", info.name, offset, info.size)
    if on_progress is not None:
        on_progress(offset)
    if offset < info.size:
        fetch = _Fetch(js, bucket, info, partial, note_path, sha, window_bytes)
        await fetch.run(offset, chunks, seq, on_progress)
    if digest_text(sha.digest()) != info.digest:
        partial.unlink(missing_ok=True)
        note_path.unlink(missing_ok=True)
        raise DigestMismatch(
            f"object {info.name} in {bucket}: the fetched bytes' SHA-256 is not the object's"
            f" digest ({info.digest}): a chunk is damaged; the partial file was removed"
        )
    partial.replace(target)
    note_path.unlink(missing_ok=True)
    return target


class _Fetch:
    """One fetch's pull consumer, window and writer."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        info: ObjectInfo,
        partial: Path,
        note_path: Path,
        sha: Any,
        window_bytes: int,
    ) -> None:
        self.js = js
        self.nc = js._nc  # the context has no public accessor for its client
        self.bucket = bucket
        self.stream = object_stream(bucket)
        self.info = info
        self.size = info.size or 0
        self.n_chunks = info.chunks or 0
        self.partial = partial
        self.note_path = note_path
        self.sha = sha
        chunk = (info.options.max_chunk_size if info.options else None) or CHUNK_BYTES
        self.window_chunks = max(2, window_bytes // chunk)
        # A block is written before the window fills, else the window would wait on it.
        self.block_limit = min(WRITE_BLOCK_BYTES, max(1, self.window_chunks // 4) * chunk)
        self.pulls = _Pulls()
        self.received = self.received_chunks = self.written = self.written_chunks = 0
        self.block: list[bytes] = []
        self.block_bytes = 0
        self.blocks: asyncio.Queue[tuple[list[bytes], int] | None] = asyncio.Queue()
        self.consumer = f"fetch-{uuid.uuid4().hex[:12]}"
        self.inbox = ""
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"
        self.failure: BaseException | None = None
        self.changed = asyncio.Event()
        self.last_data = 0.0

    async def run(self, offset: int, chunks: int, seq: int, on_progress: Progress | None) -> None:
        loop = asyncio.get_running_loop()
        self.received = self.written = offset
        self.received_chunks = self.written_chunks = chunks
        await self._add_consumer(seq)
        self.inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(self.inbox, cb=self._on_msg, pending_bytes_limit=-1)
        writer = asyncio.create_task(self._write_blocks(on_progress))
        self.last_data = loop.time()
        try:
            await self._pull()
            while self.written < self.size and self.failure is None and not writer.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), 0.5)
                self.changed.clear()
                if not self.pulls.open and self.received_chunks < self.n_chunks:
                    await self._pull()  # the previous requests ended short (or expired)
                if loop.time() - self.last_data > STALL_S:
                    raise ObjectStoreError(
                        f"object {self.info.name} in {self.bucket}: no chunk for {STALL_S:g} s"
                        f" at byte {self.received} of {self.size} (chunks missing?); run again"
                        " to resume"
                    )
            if self.failure is not None:
                raise self.failure
            if writer.done():
                writer.result()  # raises what stopped it
        finally:
            await sub.unsubscribe()
            self.blocks.put_nowait(None)
            try:
                await writer
            finally:
                with contextlib.suppress(nats.errors.Error, TimeoutError, NotFoundError):
                    # Else it goes by itself after its inactive threshold.
                    await self.js.delete_consumer(self.stream, self.consumer)

    async def _add_consumer(self, seq: int) -> None:
        """The fetch's consumer, asked for again while nobody answers: a cluster that just lost
        a server elects leaders for a few seconds (asking twice for the same consumer is
        harmless)."""
        config = ConsumerConfig(
            name=self.consumer,
            filter_subject=object_chunks_subject(self.bucket, self.info.nuid),
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if seq else DeliverPolicy.ALL,
            opt_start_seq=seq + 1 if seq else None,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
            mem_storage=True,
            num_replicas=1,
        )
        await ask_again(
            lambda: self.js.add_consumer(self.stream, config), what="creating the fetch's consumer"
        )

    async def _pull(self) -> None:
        """Ask for more chunks while the window has room: at most ``window_chunks`` requested
        or received but not yet written, so memory stays flat whatever the object's size."""
        requested = self.pulls.chunks
        left = self.n_chunks - self.received_chunks - requested
        room = self.window_chunks - requested - (self.received_chunks - self.written_chunks)
        # Half a window at a time: the next request goes out while the previous one delivers.
        batch = min(left, room, max(1, self.window_chunks // 2))
        if batch <= 0 or batch < min(left, self.window_chunks // 4):
            return
        self.pulls.open.append(batch)
        request = {"batch": batch, "expires": int(STALL_S * 1e9)}
        await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=self.inbox)

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status:
            if status != "100":  # 404, 408, 409: the oldest request is over
                self.pulls.ended()
                self.changed.set()
            return
        self.last_data = asyncio.get_running_loop().time()
        self.pulls.delivered()
        self.received += len(msg.data)
        self.received_chunks += 1
        if self.received > self.size or self.received_chunks > self.n_chunks:
            self.failure = DigestMismatch(
                f"object {self.info.name} in {self.bucket}: more bytes or chunks than its meta"
                f" says ({self.size} bytes in {self.n_chunks}): its chunks are damaged"
            )
            self.changed.set()
            return
        self.block.append(msg.data)
        self.block_bytes += len(msg.data)
        if self.block_bytes >= self.block_limit or self.received_chunks == self.n_chunks:
            self.blocks.put_nowait((self.block, msg.metadata.sequence.stream))
            self.block, self.block_bytes = [], 0
        await self._pull()

    async def _write_blocks(self, on_progress: Progress | None) -> None:
        fd = os.open(self.partial, os.O_WRONLY | os.O_APPEND)
        noted = self.written
        every = min(NOTE_EVERY_BYTES, max(1, self.size // 16))
        try:
            while (item := await self.blocks.get()) is not None:
                data, seq = item
                await asyncio.to_thread(self._write, fd, data)
                self.written += sum(len(d) for d in data)
                self.written_chunks += len(data)
                if self.written - noted >= every or self.written == self.size:
                    note = ResumeNote(
                        nuid=self.info.nuid,
                        digest=self.info.digest or "",
                        offset=self.written,
                        chunks=self.written_chunks,
                        seq=seq,
                    )
                    _write_note(self.note_path, note)
                    noted = self.written
                if on_progress is not None:
                    on_progress(self.written)
                self.changed.set()
                await self._pull()
        finally:
            os.close(fd)

    def _write(self, fd: int, data: list[bytes]) -> None:
        # hashlib and os.writev let go of the GIL: the event loop goes on receiving meanwhile.
        for d in data:
            self.sha.update(d)
        views = [memoryview(d) for d in data]
        while views:
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
