"""A node's weights cache within its budget, and a removed model's files let go of: small fake
weight files in a real cache, a worker in this process against a real nats-server (its runner
processes stubbed: the cache's upkeep needs no model)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.reader import read_stream
from bus.streams import EVENTS_STREAM
from events.catalogue import (
    Event,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    ModelEvicted,
    ModelRemoved,
    WeightFile,
    parse_event,
)
from events.records import ShardAssignment
from projectors.rules import fold
from services.models.cache_budget import CacheSize
from services.models.shared import shard_model_path, store_files
from services.models.weights_cache import WeightsCache, sha256_of
from services.runner import RunnerSpec
from services.worker.supervisor import Supervised
from services.worker.worker import Worker, WorkerConfig

SIZE = 40_000


def _file(path: Path, size: int = SIZE) -> tuple[Path, WeightFile]:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    sha = sha256_of(path)
    return path, WeightFile(name=path.name, object=f"sha256/{sha}", size=size, sha256=sha)


def _copy(cache: WeightsCache, model_id: str, size: int = SIZE) -> WeightFile:
    """A file this cache fetched (a copy among its blobs), linked into the model's directory."""
    cache.blobs.mkdir(parents=True, exist_ok=True)
    path, f = _file(cache.root / "tmp" / f"{model_id}.gguf", size)
    path.replace(cache.blob(f.sha256))
    cache.link(model_id, [f])
    return f


def _used(cache: WeightsCache, model_id: str, seconds_ago: float) -> None:
    at = time.time() - seconds_ago
    os.utime(cache.model_dir(model_id), (at, at))


def added(model_id: str, *files: WeightFile) -> ModelAdded:
    return ModelAdded(model_id=model_id, origin="t", n_layers=1, size_bytes=SIZE, files=list(files))


def test_the_cache_knows_its_copies_links_and_last_uses(tmp_path: Path) -> None:
    cache = WeightsCache(tmp_path / "models")
    copy = _copy(cache, "a")
    user_file, mine = _file(tmp_path / "user" / "mine.gguf")
    cache.adopt(user_file, mine)
    cache.link("b", [mine, copy])
    _used(cache, "a", 100)
    assert cache.blob_costs() == {copy.sha256: SIZE, mine.sha256: 0}
    models = {m.name: m for m in cache.models()}
    assert models["a"].blobs == {copy.sha256} and models["b"].blobs == {copy.sha256, mine.sha256}
    assert models["a"].last_used < models["b"].last_used
    cache.touch("a")
    assert {m.name: m for m in cache.models()}["a"].last_used > time.time() - 10

    assert cache.drop_blob(mine.sha256) == 0  # the link goes, the user's file stays
    assert user_file.read_bytes() and not cache.blob(mine.sha256).is_symlink()
    assert cache.drop_blob(copy.sha256, made_before=time.time() - 60) == 0  # made since
    assert cache.drop_blob(copy.sha256) == SIZE and not cache.blob(copy.sha256).exists()
    cache.drop_model("b")
    assert not cache.model_dir("b").exists() and user_file.exists()


@contextmanager
def _no_runner_processes(worker: Worker) -> Iterator[list[RunnerSpec]]:
    """The worker's supervisor notes the runners it would start, and starts none."""
    started: list[RunnerSpec] = []

    async def start(spec: RunnerSpec) -> None:
        started.append(spec)
        worker.supervisor.runners[spec.runner_id] = Supervised(spec)

    worker.supervisor.start = start  # type: ignore[method-assign]
    yield started


async def _logged(js: JetStreamContext, subject: str) -> list[Event]:
    return [parse_event(m.data) async for m in read_stream(js, EVENTS_STREAM, subject)]


async def test_a_runner_s_fetch_evicts_the_least_recently_used_unused_models(
    nc: Client, js: JetStreamContext, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    config = WorkerConfig(
        nats_url=nats_server.url,
        node_id="n1",
        data_dir=tmp_path / "worker",
        cache_size=CacheSize(bytes=100_000),
    )
    cache = WeightsCache(config.models_dir)
    old, recent = _copy(cache, "old"), _copy(cache, "recent")
    user_file, mine = _file(tmp_path / "user" / "mine.gguf")
    cache.adopt(user_file, mine)  # added from this machine: a link, no cost
    cache.link("mine", [mine])
    _used(cache, "mine", 400)
    _used(cache, "old", 300)
    _used(cache, "recent", 100)
    src, _ = _file(tmp_path / "src" / "next.gguf")
    (new,) = await store_files(js, [(src.name, src)])  # in the bucket only
    shard = ShardAssignment(runner_id="r0", node_id="n1", start_layer=0, end_layer=1, n_layers=1)
    worker = Worker(nc, config)
    worker.state = fold(
        [
            added("old", old),
            added("recent", recent),
            added("mine", mine),
            added("next", new),
            InstanceRequested(instance_id="i", model_id="next", origin="t"),
            InstancePlaced(instance_id="i", model_id="next", origin="t", shards=[shard]),
        ]
    )
    with _no_runner_processes(worker) as started:
        await worker._reconcile()
    assert [s.model_id for s in started] == ["next"]
    # 80,000 held + 40,000 to fetch > 100,000: the oldest model with a copy goes.
    assert not cache.model_dir("old").exists() and not cache.blob(old.sha256).exists()
    assert cache.holds(recent) and cache.holds(mine) and user_file.exists()
    (evicted,) = await _logged(js, ModelEvicted.filter_for("n1"))
    assert isinstance(evicted, ModelEvicted)
    assert (evicted.model_id, evicted.bytes_freed, evicted.budget_bytes) == ("old", SIZE, 100_000)

    # The runner's fetch then fits the budget.
    await shard_model_path(
        nc, cache, "next", [new], engine="llamacpp", rank=0, start=0, end=1, n_layers=1
    )
    assert sum(cache.blob_costs().values()) == 2 * SIZE <= 100_000


@pytest.fixture
async def running_worker(
    nc: Client, nats_server: EmbeddedNats, tmp_path: Path
) -> AsyncIterator[Worker]:
    config = WorkerConfig(
        nats_url=nats_server.url, node_id="n1", data_dir=tmp_path / "worker", heartbeat_s=60
    )
    worker = Worker(nc, config)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await task


async def test_a_removed_model_s_files_leave_each_node_s_cache(
    js: JetStreamContext, running_worker: Worker, tmp_path: Path
) -> None:
    cache = WeightsCache(running_worker.config.models_dir)
    own, shared = _copy(cache, "x"), _copy(cache, "y")
    cache.link("x", [shared])
    user_file, mine = _file(tmp_path / "user" / "mine.gguf")
    cache.adopt(user_file, mine)
    cache.link("x", [mine])
    late_file, late = _file(tmp_path / "src" / "late.gguf")
    pub = Publisher(js)
    await pub.publish(added("x", own, shared, mine, late))
    await pub.publish(added("y", shared))
    removed = ModelRemoved(model_id="x", origin="t")
    await asyncio.sleep(0.05)
    # A blob made since the removal (an add of the same file linked it, say) is kept.
    cache.blob(late.sha256).write_bytes(late_file.read_bytes())
    await pub.publish(removed)
    async with asyncio.timeout(10):
        while cache.model_dir("x").exists():
            await asyncio.sleep(0.05)
    assert not cache.blob(own.sha256).exists()  # no model names it: deleted
    assert cache.holds(shared) and cache.model_dir("y").exists()  # y names it
    assert not cache.blob(mine.sha256).is_symlink() and user_file.exists()  # only the link
    assert cache.holds(late)
