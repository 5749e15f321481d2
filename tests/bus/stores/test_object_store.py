"""Files through the models bucket: stored and fetched in chunks, read back by nats-py's own
object store client (the same layout), damaged chunks found, an interrupted fetch resumed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMetaOptions

from bus.stores.object_fetch import ResumeNote, fetch_file, partial_paths, resume_from
from bus.stores.object_store import (
    DigestMismatch,
    digest_hex,
    digest_text,
    meta_subject,
    object_chunks_subject,
    object_info,
    put_file,
)
from bus.streams import MODELS_BUCKET

CHUNK = 64 * 1024


def _random_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_a_file_goes_in_and_comes_out_the_same(js: JetStreamContext, tmp_path: Path) -> None:
    src = _random_file(tmp_path / "w.bin", 3 * 1024 * 1024 + 123)
    seen: list[int] = []
    info = await put_file(
        js, MODELS_BUCKET, "m/w.bin", src, chunk_bytes=CHUNK, on_progress=seen.append
    )
    assert info.size == src.stat().st_size and info.chunks == -(-info.size // CHUNK)
    assert info.digest is not None and digest_hex(info.digest) == _sha256(src)
    assert seen[-1] == info.size
    stored = await object_info(js, MODELS_BUCKET, "m/w.bin")
    assert stored is not None and stored.nuid == info.nuid and stored.digest == info.digest
    assert await object_info(js, MODELS_BUCKET, "m/nothing") is None

    got: list[int] = []
    out = await fetch_file(
        js,
        MODELS_BUCKET,
        stored,
        tmp_path / "cache" / "w.bin",
        on_progress=got.append,
        window_bytes=4 * CHUNK,
    )
    assert out.read_bytes() == src.read_bytes()
    assert got[0] == 0 and got[-1] == info.size
    partial, note = partial_paths(out)
    assert not partial.exists() and not note.exists()


async def test_nats_py_reads_what_is_put_and_the_other_way(
    js: JetStreamContext, tmp_path: Path
) -> None:
    src = _random_file(tmp_path / "a.bin", 700_000)
    await put_file(js, MODELS_BUCKET, "a.bin", src, chunk_bytes=CHUNK)
    store = await js.object_store(MODELS_BUCKET)
    assert (await store.get("a.bin")).data == src.read_bytes()

    other = os.urandom(500_000)
    await store.put("b.bin", other)
    info = await object_info(js, MODELS_BUCKET, "b.bin")
    assert info is not None
    out = await fetch_file(js, MODELS_BUCKET, info, tmp_path / "b.bin")
    assert out.read_bytes() == other


async def test_replacing_an_object_purges_the_old_chunks(
    js: JetStreamContext, tmp_path: Path
) -> None:
    first = await put_file(js, MODELS_BUCKET, "x", _random_file(tmp_path / "1", 200_000))
    second = await put_file(js, MODELS_BUCKET, "x", _random_file(tmp_path / "2", 100_000))
    stream = f"OBJ_{MODELS_BUCKET}"
    old = await js.stream_info(
        stream, subjects_filter=object_chunks_subject(MODELS_BUCKET, first.nuid)
    )
    assert not old.state.subjects
    info = await object_info(js, MODELS_BUCKET, "x")
    assert info is not None and info.nuid == second.nuid


async def _put_damaged(js: JetStreamContext, name: str, data: bytes, bad_chunk: int) -> None:
    """An object whose chunk ``bad_chunk`` has a flipped byte, its meta the true digest."""
    nuid = f"DAMAGED{bad_chunk}"
    chunks = [bytearray(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
    chunks[bad_chunk][17] ^= 0xFF
    for chunk in chunks:
        await js.publish(object_chunks_subject(MODELS_BUCKET, nuid), bytes(chunk))
    info = ObjectInfo(
        name=name,
        bucket=MODELS_BUCKET,
        nuid=nuid,
        size=len(data),
        chunks=len(chunks),
        digest=digest_text(hashlib.sha256(data).digest()),
        options=ObjectMetaOptions(max_chunk_size=CHUNK),
    )
    await js.publish(
        meta_subject(MODELS_BUCKET, name),
        json.dumps(info.as_dict()).encode(),
        headers={"Nats-Rollup": "sub"},
    )


async def test_a_damaged_chunk_is_found_and_nothing_is_kept(
    js: JetStreamContext, tmp_path: Path
) -> None:
    await _put_damaged(js, "bad", os.urandom(10 * CHUNK), bad_chunk=3)
    info = await object_info(js, MODELS_BUCKET, "bad")
    assert info is not None
    target = tmp_path / "bad.bin"
    with pytest.raises(DigestMismatch, match="a chunk is damaged"):
        await fetch_file(js, MODELS_BUCKET, info, target)
    assert not target.exists()
    assert not any(p.exists() for p in partial_paths(target))


async def test_an_interrupted_fetch_resumes_where_it_stopped(
    js: JetStreamContext, tmp_path: Path
) -> None:
    src = _random_file(tmp_path / "big.bin", 12 * 1024 * 1024)
    info = await put_file(js, MODELS_BUCKET, "big", src, chunk_bytes=CHUNK)
    target = tmp_path / "cache" / "big.bin"

    def stop_halfway(done: int) -> None:  # the process is stopped, as by a crash
        if done >= 5 * 1024 * 1024:
            raise Interrupted

    with pytest.raises(Interrupted):
        await fetch_file(
            js, MODELS_BUCKET, info, target, on_progress=stop_halfway, window_bytes=8 * CHUNK
        )
    partial, note_path = partial_paths(target)
    note = ResumeNote.model_validate_json(note_path.read_bytes())
    # Noted every sixteenth of the object: at most that much is fetched again.
    assert 4 * 1024 * 1024 <= note.offset < src.stat().st_size and not target.exists()

    progress: list[int] = []
    await fetch_file(js, MODELS_BUCKET, info, target, on_progress=progress.append)
    assert progress[0] == note.offset  # resumed, not started over
    assert _sha256(target) == _sha256(src)
    assert not partial.exists() and not note_path.exists()


class Interrupted(Exception):
    pass


def test_what_a_fetch_resumes_from() -> None:
    info = ObjectInfo(name="n", bucket="b", nuid="N1", size=1000, chunks=10, digest="SHA-256=x")
    note = ResumeNote(nuid="N1", digest="SHA-256=x", offset=400, chunks=4, seq=17)
    assert resume_from(note, info, partial_size=500) == note
    assert resume_from(None, info, 500) is None
    assert resume_from(note, info, partial_size=300) is None  # the partial file lost bytes
    assert resume_from(note.model_copy(update={"nuid": "N2"}), info, 500) is None  # replaced
    assert resume_from(note.model_copy(update={"digest": "SHA-256=y"}), info, 500) is None


def test_digests_are_the_object_stores_and_sha256sums() -> None:
    sha = hashlib.sha256(b"shoal")
    assert digest_hex(digest_text(sha.digest())) == sha.hexdigest()
    with pytest.raises(ValueError):
        digest_hex("MD5=abc")
