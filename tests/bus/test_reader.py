"""read_stream: one ordered pass over a range of a stream, leaving nothing behind."""

from __future__ import annotations

import contextlib
import time

import pytest
from nats.js import JetStreamContext

from bus.consumer import EventConsumer
from bus.publisher import ChunkPublisher, Publisher
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from events.catalogue import ChunkGenerated, NodeJoined, TaskCreated, parse_event

ALL_EVENTS = "shoal.events.>"


async def _fill(js: JetStreamContext, n: int) -> list[NodeJoined]:
    pub = Publisher(js)
    events = [NodeJoined(node_id=f"n{i}", origin="t") for i in range(1, n + 1)]
    for e in events:
        await pub.publish(e)
    return events


async def _seqs(
    js: JetStreamContext,
    from_seq: int = 1,
    to_seq: int | None = None,
    subject: str = ALL_EVENTS,
    batch_size: int = 5000,
) -> list[int]:
    return [
        m.metadata.sequence.stream
        async for m in read_stream(
            js, EVENTS_STREAM, subject, from_seq=from_seq, to_seq=to_seq, batch_size=batch_size
        )
    ]


async def _consumer_count(js: JetStreamContext, stream: str = EVENTS_STREAM) -> int:
    return (await js.stream_info(stream)).state.consumer_count


async def test_reads_whole_stream_in_order(js: JetStreamContext) -> None:
    events = await _fill(js, 20)
    msgs = [m async for m in read_stream(js, EVENTS_STREAM, ALL_EVENTS)]
    assert [m.metadata.sequence.stream for m in msgs] == list(range(1, 21))
    assert [parse_event(m.data) for m in msgs] == events
    assert await _consumer_count(js) == 0


@pytest.mark.parametrize(
    ("from_seq", "to_seq", "expected"),
    [
        (5, 9, list(range(5, 10))),
        (1, 1, [1]),
        (20, 20, [20]),
        (7, None, list(range(7, 21))),
        (15, 500, list(range(15, 21))),  # to_seq beyond the end
        (0, 3, [1, 2, 3]),  # from before the start
        (21, None, []),  # past the end
        (9, 8, []),  # empty range
        (100, 200, []),
    ],
)
async def test_reads_exactly_the_range(
    js: JetStreamContext, from_seq: int, to_seq: int | None, expected: list[int]
) -> None:
    await _fill(js, 20)
    started = time.monotonic()
    assert await _seqs(js, from_seq, to_seq) == expected
    assert time.monotonic() - started < 1.5
    assert await _consumer_count(js) == 0


async def test_small_batches_cover_the_range(js: JetStreamContext) -> None:
    await _fill(js, 23)
    assert await _seqs(js, 2, 22, batch_size=5) == list(range(2, 23))
    assert await _consumer_count(js) == 0


async def test_empty_stream_yields_nothing(js: JetStreamContext) -> None:
    assert await _seqs(js) == []
    assert await _seqs(js, 1, 10) == []
    assert await _consumer_count(js) == 0


async def test_to_seq_is_fixed_when_reading_starts(js: JetStreamContext) -> None:
    """Events published while reading are not part of this read."""
    await _fill(js, 5)
    pub = Publisher(js)
    seen = []
    async for m in read_stream(js, EVENTS_STREAM, ALL_EVENTS):
        seen.append(m.metadata.sequence.stream)
        if len(seen) == 1:
            await pub.publish(NodeJoined(node_id="late", origin="t"))
    assert seen == [1, 2, 3, 4, 5]
    assert (await js.stream_info(EVENTS_STREAM)).state.last_seq == 6


async def test_subject_filter(js: JetStreamContext) -> None:
    pub = Publisher(js)
    await pub.publish(NodeJoined(node_id="a", origin="t"))  # 1
    await pub.publish(TaskCreated(task_id="t1", model_id="m", origin="t"))  # 2
    await pub.publish(NodeJoined(node_id="b", origin="t"))  # 3
    await pub.publish(TaskCreated(task_id="t2", model_id="m", origin="t"))  # 4
    assert await _seqs(js, subject="shoal.events.task.>") == [2, 4]
    assert await _seqs(js, 3, 4, subject="shoal.events.task.>") == [4]
    assert await _consumer_count(js) == 0


async def test_no_consumer_left_behind_alongside_others(js: JetStreamContext) -> None:
    await _fill(js, 3)
    durable = EventConsumer(js, EVENTS_STREAM, "projector", ALL_EVENTS)
    await durable.start()
    try:
        before = await _consumer_count(js)
        assert before == 1
        assert await _seqs(js) == [1, 2, 3]
        assert await _consumer_count(js) == before
        names = [c.name for c in await js.consumers_info(EVENTS_STREAM)]
        assert names == ["projector"]
        # Reading did not take part in delivery: the durable still gets everything.
        assert [d.stream_seq for d in await durable.fetch(10, timeout=1.0)] == [1, 2, 3]
    finally:
        await durable.stop()


async def test_closing_early_removes_the_consumer(js: JetStreamContext) -> None:
    await _fill(js, 10)
    seen = []
    reader = read_stream(js, EVENTS_STREAM, ALL_EVENTS)
    async with contextlib.aclosing(reader) as it:
        async for m in it:
            seen.append(m.metadata.sequence.stream)
            if len(seen) == 3:
                assert await _consumer_count(js) == 1  # the reader's own, while reading
                break
    assert seen == [1, 2, 3]
    assert await _consumer_count(js) == 0


async def test_reads_other_streams(js: JetStreamContext) -> None:
    cp = ChunkPublisher(js)
    for i in range(10):
        await cp.publish(ChunkGenerated(task_id="t", idx=i, text=str(i), origin="n"))
    await cp.flush()
    idx = []
    async for m in read_stream(js, CHUNKS_STREAM, "shoal.chunks.>", from_seq=4, to_seq=6):
        e = parse_event(m.data)
        assert isinstance(e, ChunkGenerated)
        idx.append(e.idx)
    assert idx == [3, 4, 5]
    assert await _consumer_count(js, CHUNKS_STREAM) == 0


async def test_purged_start_is_skipped(js: JetStreamContext) -> None:
    await _fill(js, 10)
    await js.purge_stream(EVENTS_STREAM, seq=6)  # keeps 6.. (messages below 6 are removed)
    assert (await js.stream_info(EVENTS_STREAM)).state.first_seq == 6
    assert await _seqs(js, 1, 8) == [6, 7, 8]
    assert await _seqs(js, 1, 4) == []
    assert await _consumer_count(js) == 0


async def test_filtered_read_ends_promptly(js: JetStreamContext) -> None:
    pub = Publisher(js)
    await pub.publish(TaskCreated(task_id="t1", model_id="m", origin="t"))
    await pub.publish(NodeJoined(node_id="a", origin="t"))  # the last message does not match
    started = time.monotonic()
    assert await _seqs(js, subject="shoal.events.task.>") == [1]
    assert time.monotonic() - started < 1.0
