"""Publishing: acked, de-duplicated by Nats-Msg-Id, and a pipelined path for chunks."""

from __future__ import annotations

import asyncio

import pytest
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError

from bus.publisher import MSG_ID_HEADER, ChunkPublisher, Publisher
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM, ensure_streams
from events.catalogue import ChunkGenerated, InstancePlaced, NodeJoined, parse_event
from events.records import ShardAssignment


async def _count(js: JetStreamContext, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


async def test_publish_returns_acks_with_increasing_seq(js: JetStreamContext) -> None:
    pub = Publisher(js)
    seqs = []
    for i in range(5):
        ack = await pub.publish(NodeJoined(node_id=f"node-{i}", origin="test"))
        assert ack.stream == EVENTS_STREAM
        assert not ack.duplicate
        seqs.append(ack.seq)
    assert seqs == [1, 2, 3, 4, 5]
    assert await _count(js, EVENTS_STREAM) == 5


async def test_published_message_is_the_event(js: JetStreamContext) -> None:
    event = NodeJoined(node_id="Qwen.box", origin="test", hostname="h")
    ack = await Publisher(js).publish(event)
    stored = await js.get_msg(EVENTS_STREAM, ack.seq)
    assert stored.subject == event.subject == "shoal.events.node.Qwen%2Ebox.NodeJoined"
    assert stored.data is not None
    assert parse_event(stored.data) == event
    assert stored.headers is not None
    assert stored.headers[MSG_ID_HEADER] == event.event_id


async def test_same_msg_id_stores_one_message(js: JetStreamContext) -> None:
    pub = Publisher(js)
    shards = [ShardAssignment(runner_id="r", node_id="n", start_layer=0, end_layer=8, n_layers=8)]
    # Two planners decide the same placement: different events, one deterministic id.
    a = InstancePlaced(instance_id="i", model_id="m", origin="planner-1", shards=shards)
    b = InstancePlaced(instance_id="i", model_id="m", origin="planner-2", shards=shards)
    first = await pub.publish(a, msg_id="placed:i")
    assert not first.duplicate
    assert await _count(js, EVENTS_STREAM) == 1
    second = await pub.publish(b, msg_id="placed:i")
    assert second.duplicate is True
    assert second.seq == first.seq
    assert await _count(js, EVENTS_STREAM) == 1
    stored = await js.get_msg(EVENTS_STREAM, first.seq)
    assert stored.data is not None
    assert parse_event(stored.data) == a  # the first decision wins
    # A different id is a different fact.
    third = await pub.publish(b, msg_id="placed:i:2")
    assert not third.duplicate and third.seq == first.seq + 1
    assert await _count(js, EVENTS_STREAM) == 2


async def test_republishing_an_event_is_deduplicated_by_event_id(js: JetStreamContext) -> None:
    pub = Publisher(js)
    event = NodeJoined(node_id="n", origin="n")
    first = await pub.publish(event)
    again = await pub.publish(event)  # e.g. a retry after a lost ack
    assert again.duplicate is True and again.seq == first.seq
    assert await _count(js, EVENTS_STREAM) == 1


async def test_publish_without_stream_raises(js: JetStreamContext) -> None:
    await js.delete_stream(EVENTS_STREAM)
    with pytest.raises(NoStreamResponseError):
        await Publisher(js, timeout=2.0, retry_for=0).publish(NodeJoined(node_id="n", origin="n"))
    with pytest.raises(NoStreamResponseError):  # retried meanwhile, in vain
        await Publisher(js, timeout=2.0, retry_for=1.0).publish(NodeJoined(node_id="n", origin="n"))


async def test_publish_is_retried_until_the_stream_can_store(js: JetStreamContext) -> None:
    """As while a NATS cluster elects a new leader for a stream: publishing goes on, and the
    event is stored once, when the stream is back."""
    await js.delete_stream(EVENTS_STREAM)
    event = NodeJoined(node_id="n", origin="n")
    publishing = asyncio.create_task(Publisher(js, retry_for=20).publish(event))
    await asyncio.sleep(0.5)
    assert not publishing.done()
    await ensure_streams(js)
    ack = await publishing
    assert ack.seq == 1 and await _count(js, EVENTS_STREAM) == 1


async def test_chunk_publisher_pipelines_thousands_in_order(js: JetStreamContext) -> None:
    n = 2000
    cp = ChunkPublisher(js, max_in_flight=256)
    chunks = [
        ChunkGenerated(
            task_id="task.1",
            idx=i,
            text=f" tok{i}",
            token_id=i,
            origin="node-a",
            finish_reason="stop" if i == n - 1 else None,
        )
        for i in range(n)
    ]
    for c in chunks:
        await cp.publish(c)
    acks = await cp.flush()
    # Those acked while waiting for room were checked then; flush returns the rest.
    assert 0 < len(acks) <= 256
    assert all(a.stream == CHUNKS_STREAM and not a.duplicate for a in acks)
    assert await cp.flush() == []  # nothing left in flight

    info = await js.stream_info(CHUNKS_STREAM)
    assert info.state.messages == n
    assert info.state.first_seq == 1 and info.state.last_seq == n
    got = [parse_event(m.data) async for m in read_stream(js, CHUNKS_STREAM, "shoal.chunks.>")]
    assert got == chunks  # stream order is idx order
    assert all(isinstance(e, ChunkGenerated) and e.idx == i for i, e in enumerate(got))
    assert await _count(js, EVENTS_STREAM) == 0


async def test_chunk_publisher_small_window(js: JetStreamContext) -> None:
    cp = ChunkPublisher(js, max_in_flight=2)
    for i in range(50):
        await cp.publish(ChunkGenerated(task_id="t", idx=i, text="x", origin="n"))
    acks = await cp.flush()
    assert len(acks) <= 2
    assert await _count(js, CHUNKS_STREAM) == 50
    last = await js.get_last_msg(CHUNKS_STREAM, "shoal.chunks.t")
    assert last.data is not None
    last_event = parse_event(last.data)
    assert isinstance(last_event, ChunkGenerated) and last_event.idx == 49


async def test_chunk_publisher_deduplicates_by_event_id(js: JetStreamContext) -> None:
    cp = ChunkPublisher(js)
    chunk = ChunkGenerated(task_id="t", idx=0, text="x", origin="n")
    await cp.publish(chunk)
    await cp.publish(chunk)
    acks = await cp.flush()
    assert sorted(a.duplicate or False for a in acks) == [False, True]
    assert await _count(js, CHUNKS_STREAM) == 1


async def test_chunk_publisher_flush_surfaces_failures(js: JetStreamContext) -> None:
    await js.delete_stream(CHUNKS_STREAM)
    cp = ChunkPublisher(js)
    await cp.publish(ChunkGenerated(task_id="t", idx=0, text="x", origin="n"))
    with pytest.raises(NoStreamResponseError):
        await cp.flush(timeout=1.0)
    assert await cp.flush() == []  # nothing left in flight


async def test_chunk_publisher_publishes_again_until_stored(js: JetStreamContext) -> None:
    await js.delete_stream(CHUNKS_STREAM)
    cp = ChunkPublisher(js, max_in_flight=4, retry_for=20)
    chunks = [ChunkGenerated(task_id="t", idx=i, text="x", origin="n") for i in range(10)]

    async def publish_all() -> list[PubAck]:
        for c in chunks:
            await cp.publish(c)
        return await cp.flush()

    publishing = asyncio.create_task(publish_all())
    await asyncio.sleep(0.5)
    assert not publishing.done()
    await ensure_streams(js)
    await publishing
    got = [parse_event(m.data) async for m in read_stream(js, CHUNKS_STREAM, "shoal.chunks.>")]
    assert sorted(e.idx for e in got if isinstance(e, ChunkGenerated)) == list(range(10))


async def test_chunk_publisher_flush_with_nothing_in_flight(js: JetStreamContext) -> None:
    assert await ChunkPublisher(js).flush() == []
