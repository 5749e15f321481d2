"""Files in a JetStream object store bucket, streamed both ways: never a whole file in memory.

The layout is JetStream's own object store's, so that ``nats object ls/get`` and nats-py's
``js.object_store`` read what is written here: stream ``OBJ_<bucket>``, an object's chunks on
``$O.<bucket>.C.<nuid>``, its meta (JSON, rolled up: the last one counts) on
``$O.<bucket>.M.<base64url(name)>``, its digest ``SHA-256=<base64url>`` of the whole file.

It is not done with nats-py's ``ObjectStore`` because its ``get`` keeps the whole object in
memory (unless given a file to write into, and then it cannot resume), and its ``put`` waits
for each chunk's ack before sending the next. Here a put keeps chunks in flight; a fetch
(``bus/stores/object_fetch.py``) pulls a bounded window of chunks, writes and hashes them in a
thread, notes where it got to, and resumes from there after an interruption.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    ObjectInfo,
    ObjectMetaOptions,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError
from nats.nuid import NUID

from bus.leaderless import ask_again

log = logging.getLogger(__name__)

# Bytes per chunk. nats-py and Go write half as much; larger chunks mean fewer messages for
# the client to parse (bench/weights.py), and stay well under the server's max_payload.
CHUNK_BYTES = 256 * 1024
# Received chunks are written (and hashed) this many bytes at a time, in a thread.
WRITE_BLOCK_BYTES = 4 * 1024 * 1024
# A put keeps this many chunks in flight.
PUT_IN_FLIGHT = 32
# A put that knows its file's digest looks this often whether another put stored the same
# bytes under the name meanwhile, and then stops: a race sends the bytes once and a bit.
CHECK_EVERY_BYTES = 64 * 1024 * 1024
PURGE_AFTER_ACKS_S = 10.0  # a put that stops waits this long for its chunks' acks, then purges

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
    stream, subject = object_stream(bucket), meta_subject(bucket, name)
    try:
        msg = await ask_again(
            lambda: js.get_last_msg(stream, subject), pause_s=0.1, max_pause_s=1.0
        )
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
        if isinstance(exc, Exception):
            # Chunks already sent are stored whether or not their acks are awaited: waited
            # for, so that the purge comes after them and leaves none behind.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(PURGE_AFTER_ACKS_S):
                    await asyncio.gather(*in_flight, return_exceptions=True)
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
