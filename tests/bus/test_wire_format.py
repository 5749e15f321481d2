"""What `nats sub 'shoal.events.>'` shows is readable JSON: checked with a plain core NATS
subscription and json.loads alone, no project code on the reading side."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.publisher import ChunkPublisher, Publisher
from events.catalogue import ChunkGenerated, Event
from harness.history import history


async def test_core_subscription_reads_every_event_as_json(
    nc: Client, js: JetStreamContext
) -> None:
    events: list[Event] = []
    chunks: list[Event] = []
    for e in history(n_tasks=30):
        (chunks if isinstance(e, ChunkGenerated) else events).append(e)
    assert len(events) > 100 and chunks

    received: list[Msg] = []
    all_in = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        received.append(msg)
        if len(received) >= len(events):
            all_in.set()

    sub = await nc.subscribe("shoal.events.>", cb=on_msg)  # core NATS, not JetStream
    await nc.flush()
    pub = Publisher(js)
    for e in events:
        await pub.publish(e)
    cp = ChunkPublisher(js)
    for c in chunks:
        await cp.publish(c)  # chunks are on shoal.chunks.>, and must not show up here
    await cp.flush()
    await asyncio.wait_for(all_in.wait(), 10)
    await asyncio.sleep(0.1)  # anything extra would arrive now
    await sub.unsubscribe()

    assert len(received) == len(events)
    assert [m.subject for m in received] == [e.subject for e in events]
    types_seen = set()
    for msg, event in zip(received, events, strict=True):
        text = msg.data.decode("utf-8")  # readable text
        doc = json.loads(text)
        assert isinstance(doc, dict)
        assert isinstance(doc["type"], str) and doc["type"]
        assert isinstance(doc["event_id"], str) and doc["event_id"]
        assert isinstance(doc["ts"], str)
        datetime.fromisoformat(doc["ts"])  # an ISO timestamp, not a number
        assert isinstance(doc["origin"], str) and doc["origin"]
        assert isinstance(doc["v"], int)
        # The subject a human filters on names the type, and agrees with the payload.
        assert msg.subject.startswith("shoal.events.")
        assert msg.subject.rsplit(".", 1)[1] == doc["type"]
        assert doc["type"] == type(event).__name__
        assert doc["event_id"] == event.event_id
        types_seen.add(doc["type"])
    assert len(types_seen) >= 12  # a realistic mix of the catalogue


async def test_core_subscription_reads_chunks_as_json(nc: Client, js: JetStreamContext) -> None:
    chunks = [e for e in history(n_tasks=5) if isinstance(e, ChunkGenerated)]
    received: list[Msg] = []
    all_in = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        received.append(msg)
        if len(received) >= len(chunks):
            all_in.set()

    sub = await nc.subscribe("shoal.chunks.>", cb=on_msg)
    await nc.flush()
    cp = ChunkPublisher(js)
    for c in chunks:
        await cp.publish(c)
    await cp.flush()
    await asyncio.wait_for(all_in.wait(), 10)
    await sub.unsubscribe()
    docs = [json.loads(m.data) for m in received]
    assert [d["type"] for d in docs] == ["ChunkGenerated"] * len(chunks)
    assert [(d["task_id"], d["idx"], d["text"]) for d in docs] == [
        (c.task_id, c.idx, c.text) for c in chunks
    ]
