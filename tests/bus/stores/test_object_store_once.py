"""One object per name, whatever races: two puts at once store one copy (nats-py's own put
stores two, and the loser's chunks stay in the stream for good), a put stops once another has
stored its bytes, and a deleted object's chunks leave the stream. Against a real nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo
from nats.js.errors import ObjectNotFoundError

import bus.stores.object_store
from bus.stores.object_store import (
    ObjectStoreError,
    delete_object,
    object_info,
    put_file,
)
from bus.streams import MODELS_BUCKET
from services.models.shared import store_files

CHUNK = 16 * 1024
STREAM = f"OBJ_{MODELS_BUCKET}"


def _copies(directory: Path, size: int, n: int = 2) -> list[Path]:
    """``n`` files of the same bytes (what two machines' adds of one model would read)."""
    data = os.urandom(size)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"copy-{i}.bin"
        path.write_bytes(data)
        paths.append(path)
    return paths


async def _messages(js: JetStreamContext) -> int:
    return (await js.stream_info(STREAM)).state.messages


async def test_two_puts_of_one_name_at_once_store_one_copy(
    js: JetStreamContext, tmp_path: Path
) -> None:
    a, b = _copies(tmp_path, 1_000_000)
    first, second = await asyncio.gather(
        put_file(js, MODELS_BUCKET, "x", a, chunk_bytes=CHUNK),
        put_file(js, MODELS_BUCKET, "x", b, chunk_bytes=CHUNK),
    )
    assert first.nuid == second.nuid  # the second put returned the first one's object
    stored = await object_info(js, MODELS_BUCKET, "x")
    assert stored is not None and stored.nuid == first.nuid
    assert first.chunks is not None
    assert await _messages(js) == first.chunks + 1  # its chunks and one meta: nothing else


async def test_two_puts_of_other_bytes_at_once_keep_the_first(
    js: JetStreamContext, tmp_path: Path
) -> None:
    (a,), (b,) = _copies(tmp_path / "a", 400_000, 1), _copies(tmp_path / "b", 400_000, 1)
    results = await asyncio.gather(
        put_file(js, MODELS_BUCKET, "y", a, chunk_bytes=CHUNK),
        put_file(js, MODELS_BUCKET, "y", b, chunk_bytes=CHUNK),
        return_exceptions=True,
    )
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], ObjectStoreError)
    assert "stored by another put" in str(lost[0])
    assert won[0].chunks is not None and await _messages(js) == won[0].chunks + 1


async def test_a_put_of_stored_bytes_sends_nothing(js: JetStreamContext, tmp_path: Path) -> None:
    a, b = _copies(tmp_path, 300_000)
    sha = hashlib.sha256(a.read_bytes()).hexdigest()
    first = await put_file(js, MODELS_BUCKET, "s", a, chunk_bytes=CHUNK)
    before = await _messages(js)
    sent: list[int] = []
    again = await put_file(
        js, MODELS_BUCKET, "s", b, chunk_bytes=CHUNK, sha256=sha, on_progress=sent.append
    )
    assert again.nuid == first.nuid and await _messages(js) == before and not sent


async def test_a_put_stops_once_another_stored_its_bytes(
    js: JetStreamContext, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 2 * bus.stores.object_store.WRITE_BLOCK_BYTES + 1000
    a, b = _copies(tmp_path, size)
    sha = hashlib.sha256(a.read_bytes()).hexdigest()
    first = await put_file(js, MODELS_BUCKET, "z", a)
    before = await _messages(js)
    # The second put began before the first was stored: its first look finds nothing.
    real_meta = bus.stores.object_store._meta
    looks: list[str] = []

    async def meta(js: JetStreamContext, bucket: str, name: str) -> tuple[ObjectInfo | None, int]:
        looks.append(name)
        return (None, 0) if len(looks) == 1 else await real_meta(js, bucket, name)

    monkeypatch.setattr(bus.stores.object_store, "_meta", meta)
    monkeypatch.setattr(bus.stores.object_store, "CHECK_EVERY_BYTES", 1)
    sent: list[int] = []
    again = await put_file(js, MODELS_BUCKET, "z", b, sha256=sha, on_progress=sent.append)
    assert again.nuid == first.nuid and await _messages(js) == before  # its chunks purged
    assert max(sent) < size  # it stopped after its first block


async def test_concurrent_adds_of_one_file_store_it_once(
    js: JetStreamContext, tmp_path: Path
) -> None:
    a, b = _copies(tmp_path, 700_000)
    one, two = await asyncio.gather(
        store_files(js, [("w.gguf", a)]), store_files(js, [("w.gguf", b)])
    )
    assert one == two
    stored = await object_info(js, MODELS_BUCKET, one[0].object)
    assert stored is not None and stored.chunks is not None
    assert await _messages(js) == stored.chunks + 1


async def test_a_deleted_object_leaves_a_marker_and_can_be_put_again(
    js: JetStreamContext, tmp_path: Path
) -> None:
    (a,) = _copies(tmp_path, 300_000, 1)
    info = await put_file(js, MODELS_BUCKET, "d", a, chunk_bytes=CHUNK)
    deleted = await delete_object(js, MODELS_BUCKET, "d")
    assert deleted is not None and deleted.nuid == info.nuid
    assert await object_info(js, MODELS_BUCKET, "d") is None
    assert await _messages(js) == 1  # the marker
    assert await delete_object(js, MODELS_BUCKET, "d") is None  # nothing left to delete
    store = await js.object_store(MODELS_BUCKET)  # nats-py's client agrees it is gone
    with pytest.raises(ObjectNotFoundError):
        await store.get("d")
    again = await put_file(js, MODELS_BUCKET, "d", a, chunk_bytes=CHUNK)
    assert (await store.get("d")).data == a.read_bytes() and again.chunks is not None
    assert await _messages(js) == again.chunks + 1
