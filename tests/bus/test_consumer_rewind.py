"""A stored consumer whose state outlived the tail its stream lost (a power cut: the stream's
unsynced writes gone, the consumer's position not) re-reads from the stream's end and gets
every event stored afterwards (real nats-server; the loss played by putting back an older copy
of the stream's files under the newer consumer's). nats-server 2.14 and later reset such a
consumer themselves at their start ("delivered sequence past last stream sequence"); Shoal's own
check (``EventConsumer``, at start and after each reconnect) is for older servers."""

from __future__ import annotations

import shutil
from pathlib import Path

from nats.js.api import DeliverPolicy

from bus.connection import connect
from bus.consumer import EventConsumer
from bus.embedded import EmbeddedNats
from bus.log_position import consumer_past_end
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import NodeJoined

FILTER = NodeJoined.filter_for()


def test_consumer_past_end() -> None:
    assert consumer_past_end(12, 10, 11)
    assert consumer_past_end(0, 12, 11)
    assert not consumer_past_end(11, 11, 11)
    assert not consumer_past_end(3, 2, 11)


async def _publish(url: str, names: list[str]) -> None:
    nc = await connect(url, name="test")
    try:
        for name in names:
            await Publisher(nc.jetstream()).publish(NodeJoined(node_id=name, origin="t"))
    finally:
        await nc.close()


async def _take(url: str, n: int) -> list[str]:
    """The next ``n`` events the durable consumer gives (acked)."""
    nc = await connect(url, name="test")
    consumer = EventConsumer(
        nc.jetstream(), EVENTS_STREAM, "nodes", FILTER, deliver_policy=DeliverPolicy.ALL
    )
    got: list[str] = []
    try:
        await consumer.start()
        while len(got) < n:
            for d in await consumer.fetch(n - len(got), timeout=5):
                assert isinstance(d.event, NodeJoined)
                got.append(d.event.node_id)
                await d.ack()
    finally:
        await consumer.stop()
        await nc.close()
    return got


async def test_a_consumer_past_the_streams_end_reads_what_comes_next(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    store = server.data_dir / "jetstream" / "jetstream" / "$G" / "streams" / EVENTS_STREAM
    server.start()
    try:
        nc = await connect(server.url, name="test")
        await ensure_streams(nc.jetstream())
        await nc.close()
        await _publish(server.url, ["a", "b"])
        assert await _take(server.url, 2) == ["a", "b"]
        server.stop()
        shutil.copytree(store / "msgs", tmp_path / "msgs-copy")

        server.start()
        await _publish(server.url, ["lost-1", "lost-2", "lost-3"])
        assert await _take(server.url, 3) == ["lost-1", "lost-2", "lost-3"]
        server.kill()
        # The stream's tail lost, the consumer's position (in obs/) kept.
        shutil.rmtree(store / "msgs")
        shutil.copytree(tmp_path / "msgs-copy", store / "msgs")
        (store / "msgs" / "index.db").unlink(missing_ok=True)

        server.start()
        await _publish(server.url, ["after-1", "after-2"])
        assert await _take(server.url, 2) == ["after-1", "after-2"]
    finally:
        server.stop()
