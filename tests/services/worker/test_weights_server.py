"""Weights from another node's disk: a worker's weights server gives the files its cache holds,
over HTTP, to whoever asked over NATS; the fetch resumes, checks the digest and falls back to
the bucket. Real nats-server, real sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.stores.object_fetch import partial_paths
from bus.streams import MODELS_BUCKET
from events.catalogue import WeightFile
from events.units import MiB
from services.models.shared import WeightsUnavailable, fetch_files, store_files
from services.models.weight_offers import ask_for_offer
from services.models.weights_cache import WeightsCache, sha256_of
from services.worker import weights_server
from services.worker.weights_server import WeightsServer


@pytest.fixture
async def holder(nc: Client, tmp_path: Path) -> AsyncIterator[WeightsServer]:
    """Node "a": its cache, served as its worker serves it."""
    server = WeightsServer(WeightsCache(tmp_path / "a" / "models"), "127.0.0.1", "a")
    server.start()
    sub = await server.answer(nc)
    yield server
    await sub.unsubscribe()
    server.stop()


def _write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))


async def _held(js: JetStreamContext, server: WeightsServer, path: Path, size: int) -> WeightFile:
    """A file added on node "a" (linked into its cache, not stored in the bucket)."""
    await asyncio.to_thread(_write_random, path, size)
    (f,) = await store_files(js, [(path.name, path)], cache=server.cache, put=False)
    return f


async def _bucket_messages(js: JetStreamContext) -> int:
    return (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages


async def test_a_file_held_by_a_node_is_fetched_from_its_disk_not_the_bucket(
    nc: Client, js: JetStreamContext, holder: WeightsServer, tmp_path: Path
) -> None:
    f = await _held(js, holder, tmp_path / "src" / "w.gguf", 9 * MiB + 123)
    assert holder.cache.holds(f) and holder.cache.blob(f.sha256).is_symlink()
    assert await _bucket_messages(js) == 0  # one copy: the file itself

    cache = WeightsCache(tmp_path / "b" / "models")
    seen: list[tuple[int, int]] = []
    await fetch_files(nc, cache, [f], lambda d, t: seen.append((d, t)), node_id="b")
    blob = cache.blob(f.sha256)
    assert blob.is_file() and not blob.is_symlink()
    assert sha256_of(blob) == f.sha256
    assert seen[-1] == (f.size, f.size)
    assert await _bucket_messages(js) == 0

    # Node "b" holds it now too, and answers for it; nobody answers a node for itself.
    b = WeightsServer(cache, "127.0.0.1", "b")
    b.start()
    sub = await b.answer(nc)
    try:
        holder.cache.blob(f.sha256).unlink()  # "a" lost it
        offer = await ask_for_offer(nc, "c", [f], 2.0)
        assert offer is not None and offer.node_id == "b" and offer.sha256s == [f.sha256]
        assert await ask_for_offer(nc, "b", [f], 1.0) is None
    finally:
        await sub.unsubscribe()
        b.stop()


class Stop(Exception):
    pass


async def test_a_fetch_from_a_node_stopped_halfway_resumes(
    nc: Client, js: JetStreamContext, holder: WeightsServer, tmp_path: Path
) -> None:
    f = await _held(js, holder, tmp_path / "src" / "w.gguf", 24 * MiB)
    cache = WeightsCache(tmp_path / "b" / "models")

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise Stop

    with pytest.raises(Stop):
        await fetch_files(nc, cache, [f], stop, node_id="b")
    partial, _ = partial_paths(cache.blob(f.sha256))
    assert partial.stat().st_size > 12 * MiB and not cache.holds(f)
    resumed: list[int] = []
    await fetch_files(nc, cache, [f], lambda d, t: resumed.append(d), node_id="b")
    assert resumed[0] > 12 * MiB  # from where it stopped, not from 0
    assert sha256_of(cache.blob(f.sha256)) == f.sha256 and not partial.exists()


async def test_damaged_or_gone_bytes_fall_back_to_the_bucket_or_say_why(
    nc: Client, js: JetStreamContext, holder: WeightsServer, tmp_path: Path
) -> None:
    src = tmp_path / "src" / "w.gguf"
    f = await _held(js, holder, src, 2 * MiB)
    await store_files(js, [(src.name, src)])  # and a copy in the bucket
    original = src.read_bytes()
    src.write_bytes(b"x" * f.size)  # the holder's file changed under it: same size, other bytes

    cache = WeightsCache(tmp_path / "b" / "models")
    await fetch_files(nc, cache, [f], node_id="b")  # the digest refused it; the bucket had it
    assert cache.blob(f.sha256).read_bytes() == original

    other = WeightsCache(tmp_path / "c" / "models")
    gone = f.model_copy(update={"sha256": "b" * 64, "object": "sha256/" + "b" * 64})
    with pytest.raises(WeightsUnavailable, match="no node that holds it answered"):
        await fetch_files(nc, other, [gone], node_id="c")


def _get(url: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_the_http_side_gives_nothing_without_a_ticket_for_that_file(
    nc: Client, js: JetStreamContext, holder: WeightsServer, tmp_path: Path
) -> None:
    f = await _held(js, holder, tmp_path / "src" / "w.gguf", 1000)
    g = await _held(js, holder, tmp_path / "src" / "v.gguf", 1000)
    offer = await ask_for_offer(nc, "b", [f], 2.0)
    assert offer is not None
    url = offer.url

    def blob(sha256: str) -> str:
        return f"{url}/blobs/{sha256}"

    get = asyncio.to_thread
    assert await get(_get, blob(f.sha256), {"Authorization": f"Bearer {offer.ticket}"}) == 200
    assert await get(_get, blob(f.sha256), {}) == 403
    assert await get(_get, blob(f.sha256), {"Authorization": "Bearer forged"}) == 403
    assert await get(_get, blob(g.sha256), {"Authorization": f"Bearer {offer.ticket}"}) == 403
    assert await get(_get, f"{offer.url}/../etc/passwd", {}) == 404
    ranged = {"Authorization": f"Bearer {offer.ticket}", "Range": "bytes=2000-"}
    assert await get(_get, blob(f.sha256), ranged) == 416


async def test_silent_and_surplus_connections_are_dropped_at_once(
    holder: WeightsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once, a connection that sent nothing held a thread for 60 s before any ticket was
    checked, and connections were not bounded: a thread each."""
    monkeypatch.setattr(weights_server, "HEAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(weights_server, "MAX_CONNECTIONS", 2)
    holder.stop()  # started again with these
    holder.start()
    host, port = holder.url.removeprefix("http://").rsplit(":", 1)

    def silent() -> float:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            started = time.monotonic()
            assert sock.recv(100) == b""  # closed by the server, unanswered
            return time.monotonic() - started

    held = [socket.create_connection((host, int(port))) for _ in range(2)]
    try:
        assert await asyncio.to_thread(silent) < 0.2  # the third: closed at once
    finally:
        for sock in held:
            sock.close()
    await asyncio.sleep(0.5)  # the held ones timed out
    assert await asyncio.to_thread(silent) < 5  # a silent one: closed after the head timeout
