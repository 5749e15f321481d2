"""Files in a JetStream object store bucket, streamed both ways: never a whole file in memory.

The layout is JetStream's own object store's, so that ``nats object ls/get`` and nats-py's
``js.object_store`` read what is written here: stream ``OBJ_<bucket>``, an object's chunks on
``$O.<bucket>.C.<nuid>``, its meta (JSON, rolled up: the last one counts) on
``$O.<bucket>.M.<base64url(name)>``, its digest ``SHA-256=<base64url>`` of the whole file.

It is not done with nats-py's ``ObjectStore`` because its ``get`` keeps the whole object in
memory (unless given a file to write into, and then it cannot resume), and its ``put`` waits
for each chunk's ack before sending the next. Here a put keeps chunks in flight, and a fetch
pulls a bounded window of chunks, writes and hashes them in a thread, notes where it got to,
and resumes from there after an interruption.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    ObjectInfo,
    ObjectMetaOptions,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError
from nats.nuid import NUID
from pydantic import BaseModel, ConfigDict

from bus.leaderless import ask_again

log = logging.getLogger(__name__)

# Bytes per chunk. nats-py and Go write half as much; larger chunks mean fewer messages for
# the client to parse (bench/weights.py), and stay well under the server's max_payload.
CHUNK_BYTES = 256 * 1024
# A fetch has at most this much requested but not yet written: its memory, whatever the size.
FETCH_WINDOW_BYTES = 16 * 1024 * 1024
# Received chunks are written (and hashed) this many bytes at a time, in a thread.
WRITE_BLOCK_BYTES = 4 * 1024 * 1024
# A fetch notes where it got to (for a resume) after a sixteenth of the object, at most this
# many bytes: a resumed fetch fetches that much again at most, and each note is a file
# written and renamed (noted at every block, they took a large share of a fetch's time).
NOTE_EVERY_BYTES = 64 * 1024 * 1024
# A put keeps this many chunks in flight.
PUT_IN_FLIGHT = 32
# A fetch that receives nothing for this long gives up (and resumes when run again).
STALL_S = 20.0
# A put that knows its file's digest looks this often whether another put stored the same
# bytes under the name meanwhile, and then stops: a race sends the bytes once and a bit.
CHECK_EVERY_BYTES = 64 * 1024 * 1024

_DIGEST_PREFIX = "SHA-256="
_ROLLUP = {"Nats-Rollup": "sub"}
# JetStream stores a message with this header only if the last one on its subject has that
# sequence (0: there is none), so that of two puts of one name only one stores its meta.
_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when it is not


class ObjectStoreError(RuntimeError):
    """An object cannot be stored or fetched; the message says which and why."""


class ObjectMissing(ObjectStoreError):
    """No such object in the bucket (or it was deleted)."""


class DigestMismatch(ObjectStoreError):
    """What was fetched is not what the object's digest says: a chunk is damaged."""


# --- names --------------------------------------------------------------------------------


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def object_chunks_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def bucket_config(bucket: str, replicas: int = 1) -> StreamConfig:
    """The stream behind a bucket, as ``js.create_object_store`` makes it, with ``replicas``."""
    return StreamConfig(
        name=object_stream(bucket),
        description=f"object store {bucket}",
        subjects=[f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_bytes=-1,
        num_replicas=replicas,
        discard=DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        allow_direct=True,
    )


def digest_text(sha256: bytes) -> str:
    """The object store's form of a SHA-256: ``SHA-256=<base64url>``."""
    return _DIGEST_PREFIX + base64.urlsafe_b64encode(sha256).decode()


def digest_hex(digest: str) -> str:
    """``SHA-256=<base64url>`` as 64 hex digits (what a file's ``sha256sum`` prints)."""
    if not digest.upper().startswith(_DIGEST_PREFIX):
        raise ValueError(f"not a SHA-256 digest: {digest!r}")
    return base64.urlsafe_b64decode(digest[len(_DIGEST_PREFIX) :]).hex()


def hex_digest_text(hex_digest: str) -> str:
    return digest_text(bytes.fromhex(hex_digest))


# --- reading the meta ---------------------------------------------------------------------


async def object_info(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    """The object's meta, or None when the bucket has no such object (or it was deleted)."""
    return (await _meta(js, bucket, name))[0]


async def _meta(js: JetStreamContext, bucket: str, name: str) -> tuple[ObjectInfo | None, int]:
    """The object's meta (None: no such object, or deleted) and the stream sequence of its meta
    subject's last message (0: none), which a later write of the meta expects."""
    try:
        msg = await js.get_last_msg(object_stream(bucket), meta_subject(bucket, name))
    except NotFoundError:
        return None, 0
    if not msg.data:
        return None, msg.seq or 0
    info = ObjectInfo.from_response(json.loads(msg.data))
    return (None if info.deleted else info), msg.seq or 0


def same_bytes(info: ObjectInfo | None, sha256: str, size: int) -> bool:
    """Whether ``info`` is an object of the file with this SHA-256 (hex) and size."""
    if info is None or info.size != size or not info.digest:
        return False
    try:
        return digest_hex(info.digest) == sha256
    except ValueError:
        return False


async def delete_object(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    """Delete object ``name`` as JetStream's object store does (its meta marked deleted, its
    chunks purged); the object that was deleted, or None when there was none."""
    info, seq = await _meta(js, bucket, name)
    if info is None:
        return None
    gone = ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=info.nuid,
        size=0,
        chunks=0,
        mtime=datetime.now(UTC).isoformat(),
        digest="",
        deleted=True,
    )
    try:
        # Only over the meta it read: a put that stored another object meanwhile keeps it.
        await js.publish(
            meta_subject(bucket, name),
            json.dumps(gone.as_dict()).encode(),
            headers={**_ROLLUP, _EXPECTED_LAST: str(seq)},
        )
    except APIError as exc:
        if exc.err_code != _WRONG_LAST_SEQUENCE:
            raise
        log.info("object %s in %s was stored again meanwhile: kept", name, bucket)
        return None
    await _purge_quietly(js, object_stream(bucket), object_chunks_subject(bucket, info.nuid))
    return info


# --- put ----------------------------------------------------------------------------------

Progress = Callable[[int], None]


async def put_file(
    js: JetStreamContext,
    bucket: str,
    name: str,
    path: Path,
    *,
    description: str | None = None,
    headers: dict[str, str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    on_progress: Progress | None = None,
    sha256: str | None = None,
) -> ObjectInfo:
    """Store the file at ``path`` as object ``name``, chunk by chunk, with its SHA-256.

    The file is read in a thread and up to ``PUT_IN_FLIGHT`` chunks are unacknowledged at
    once. A put that fails purges its chunks (the object keeps what it was, if anything); one
    that replaces an object purges the old one's chunks after the new meta is stored.
    ``on_progress`` gets the bytes stored so far. Given the file's ``sha256`` (hex), an
    object of those bytes under ``name`` is kept as it is (nothing is sent).

    Two puts of one name at once store one object: the meta is written only over the one the
    put started from, so the put that comes second purges its chunks and returns the first
    one's object when it holds the same bytes (else ``ObjectStoreError``). Given ``sha256``, a
    put also stops early once another has stored those bytes."""
    nuid = NUID().next().decode()
    subject = object_chunks_subject(bucket, nuid)
    stream = object_stream(bucket)
    previous, previous_seq = await _meta(js, bucket, name)
    sha = hashlib.sha256()
    size = chunks = checked = 0
    in_flight: deque[asyncio.Future[Any]] = deque()
    try:
        with path.open("rb") as f:
            total = os.fstat(f.fileno()).st_size
            if sha256 is not None and previous is not None and same_bytes(previous, sha256, total):
                return previous  # stored already: a put of a content name is idempotent
            while True:
                if sha256 is not None and size - checked >= CHECK_EVERY_BYTES:
                    checked = size
                    other = await object_info(js, bucket, name)
                    if other is not None and same_bytes(other, sha256, total):
                        raise _StoredElsewhere(other)
                block = await asyncio.to_thread(f.read, WRITE_BLOCK_BYTES)
                if not block:
                    break
                view = memoryview(block)
                for start in range(0, len(block), chunk_bytes):
                    chunk = view[start : start + chunk_bytes]
                    if len(in_flight) >= PUT_IN_FLIGHT:
                        await in_flight.popleft()
                    in_flight.append(await js.publish_async(subject, bytes(chunk)))
                    chunks += 1
                sha.update(block)
                size += len(block)
                if on_progress is not None:
                    on_progress(size)
        while in_flight:
            await in_flight.popleft()
        info = ObjectInfo(
            name=name,
            bucket=bucket,
            nuid=nuid,
            size=size,
            chunks=chunks,
            mtime=datetime.now(UTC).isoformat(),
            digest=digest_text(sha.digest()),
            description=description,
            headers=headers,
            options=ObjectMetaOptions(max_chunk_size=chunk_bytes),
        )
        await js.publish(
            meta_subject(bucket, name),
            json.dumps(info.as_dict()).encode(),
            headers={**_ROLLUP, _EXPECTED_LAST: str(previous_seq)},
        )
    except BaseException as exc:
        for fut in in_flight:
            fut.cancel()
        await _purge_quietly(js, stream, subject)
        if isinstance(exc, _StoredElsewhere):
            log.info("%s in %s: stored by another put meanwhile", name, bucket)
            return exc.info
        if isinstance(exc, APIError) and exc.err_code == _WRONG_LAST_SEQUENCE:
            other = await object_info(js, bucket, name)
            if other is not None and same_bytes(other, sha.hexdigest(), size):
                log.info("%s in %s: stored by another put meanwhile", name, bucket)
                return other
            raise ObjectStoreError(
                f"object {name} in {bucket} was stored by another put meanwhile, with other"
                " bytes; put again to replace it"
            ) from exc
        raise
    if previous is not None and previous.nuid != nuid:
        await _purge_quietly(js, stream, object_chunks_subject(bucket, previous.nuid))
    return info


class _StoredElsewhere(Exception):
    """Another put stored the bytes this one was storing: it stops."""

    def __init__(self, info: ObjectInfo) -> None:
        super().__init__(info.name)
        self.info = info


async def _purge_quietly(js: JetStreamContext, stream: str, subject: str) -> None:
    try:
        await js.purge_stream(stream, subject=subject)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("could not purge %s: %r", subject, exc)


# --- fetch --------------------------------------------------------------------------------


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
