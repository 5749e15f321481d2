"""A 3-server NATS cluster with JetStream replicas 3: one server is lost (stopped, or killed)
while every client publishes and consumes. Nothing is lost or stored twice, every publish
succeeds, clients move to the servers left, and the lost server catches up when it is back."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy, PubAck

from api.task_stream import TaskStream
from bus.connection import connect
from bus.consumer import EventConsumer
from bus.publisher import ChunkPublisher, Publisher
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM, StreamSettings, ensure_streams
from events.catalogue import (
    ChunkGenerated,
    EventBase,
    NodeJoined,
    TaskCompleted,
    TaskCreated,
    parse_event,
)
from events.records import ChatMessage, Timings, Usage
from harness.clusters import NatsCluster
from harness.history import history
from harness.hosts import Network
from projectors import database
from projectors.rules import fold
from tests.bus.nats_cluster import make_consumer_leader, make_leader, stream_info
from tests.projectors.helpers import db_rows, memory_rows, running_projector, wait_for_seq

PER_CLIENT = 150  # events each of the three clients publishes
CHUNKS = 300
VICTIM = 1  # the server that is lost: it leads both streams, and one client is on it

pytestmark = pytest.mark.slow  # three nats-servers, each lost in turn


@pytest.fixture
async def cluster(tmp_path: Path, hosts: Network) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "nats", hosts) as c:
        yield c


async def _publish_events(client: Client, name: str, out: list[PubAck]) -> list[str]:
    """Publish PER_CLIENT events, a few milliseconds apart; returns their ids."""
    pub = Publisher(client.jetstream())
    ids = []
    for i in range(PER_CLIENT):
        event = NodeJoined(node_id=f"{name}-{i}", origin=name)
        out.append(await pub.publish(event))
        ids.append(event.event_id)
        await asyncio.sleep(0.01)
    return ids


async def _publish_chunks(client: Client) -> None:
    cp = ChunkPublisher(client.jetstream())
    for i in range(CHUNKS):
        await cp.publish(ChunkGenerated(task_id="t", idx=i, text="x", origin="runner"))
        await asyncio.sleep(0.005)
    await cp.flush()


async def _pull_all(consumer: EventConsumer, seqs: set[int], want: int) -> None:
    while len(seqs) < want:
        for d in await consumer.fetch(50, timeout=1.0):
            seqs.add(d.stream_seq)
            await d.ack()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_losing_a_server_loses_no_event(cluster: NatsCluster, how: signal.Signals) -> None:
    clients = [await connect(cluster.urls_from(i), name=f"c{i}") for i in range(3)]
    background: list[asyncio.Task[object]] = []
    try:
        # Each client is on the server its URL list names first.
        assert [c.connected_url.netloc for c in clients if c.connected_url] == [
            u.removeprefix("nats://") for u in cluster.urls
        ]
        await ensure_streams(clients[0].jetstream(), StreamSettings(replicas=3))
        for stream in (EVENTS_STREAM, CHUNKS_STREAM):
            info = await stream_info(clients[0], stream)
            assert info.config.num_replicas == 3
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
            await make_leader(clients[0], stream, f"n{VICTIM}")

        # Watching: an ordered consumer through the client on the lost server, and a durable
        # pull consumer (replicated like its stream) through another.
        watched: list[int] = []

        async def on_msg(msg: Msg) -> None:
            watched.append(msg.metadata.sequence.stream)

        watch = (
            await clients[VICTIM]
            .jetstream()
            .subscribe(
                "shoal.events.>", cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
            )
        )
        durable = EventConsumer(
            clients[2].jetstream(), EVENTS_STREAM, "cluster-test", "shoal.events.>"
        )
        await durable.start()
        pulled: set[int] = set()
        pulling = asyncio.create_task(_pull_all(durable, pulled, 3 * PER_CLIENT))

        acks: list[PubAck] = []
        publishing = [
            asyncio.create_task(_publish_events(c, f"c{i}", acks)) for i, c in enumerate(clients)
        ]
        chunking = asyncio.create_task(_publish_chunks(clients[VICTIM]))
        background += [pulling, chunking, *publishing]
        while len(acks) < PER_CLIENT:  # a third of the way
            await asyncio.sleep(0.01)
        server = cluster.servers[VICTIM]
        if how == signal.SIGKILL:
            server.kill()
        else:
            server.stop()

        # Every publish succeeds, those through the lost server's client included.
        async with asyncio.timeout(90):
            ids = [i for ids in await asyncio.gather(*publishing) for i in ids]
            await chunking
        total = 3 * PER_CLIENT
        assert len(acks) == total
        assert sorted({a.seq for a in acks}) == list(range(1, total + 1))

        # The two servers left keep quorum: the streams have a leader among them.
        for stream in (EVENTS_STREAM, CHUNKS_STREAM):
            info = await stream_info(clients[0], stream)
            assert info.cluster is not None and info.cluster.leader in ("n0", "n2")
        # The client on the lost server moved to another one.
        moved = clients[VICTIM].connected_url
        assert moved is not None and f"nats://{moved.netloc}" != server.url

        # No gap, no duplicate: seqs 1..total, each event once.
        info = await stream_info(clients[0], EVENTS_STREAM)
        assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (total, 1, total)
        stored = [
            m async for m in read_stream(clients[0].jetstream(), EVENTS_STREAM, "shoal.events.>")
        ]
        assert [m.metadata.sequence.stream for m in stored] == list(range(1, total + 1))
        assert sorted(parse_event(m.data).event_id for m in stored) == sorted(ids)
        chunks = [
            parse_event(m.data)
            async for m in read_stream(clients[0].jetstream(), CHUNKS_STREAM, "shoal.chunks.>")
        ]
        assert sorted(c.idx for c in chunks if isinstance(c, ChunkGenerated)) == list(range(CHUNKS))

        # Both consumers saw every event: the ordered one in order, exactly once.
        async with asyncio.timeout(30):
            await pulling
            while len(watched) < total:
                await asyncio.sleep(0.1)
        assert pulled == set(range(1, total + 1))
        assert watched == list(range(1, total + 1))
        await watch.unsubscribe()
        await durable.stop()

        # Back, the lost server catches up: made the leader, it serves the whole log.
        await asyncio.to_thread(server.start)
        await make_leader(clients[0], EVENTS_STREAM, f"n{VICTIM}", timeout=60)
        after = await Publisher(clients[0].jetstream()).publish(NodeJoined(node_id="x", origin="t"))
        assert after.seq == total + 1
        again = [
            m async for m in read_stream(clients[0].jetstream(), EVENTS_STREAM, "shoal.events.>")
        ]
        assert [m.metadata.sequence.stream for m in again] == list(range(1, total + 2))
        assert [m.data for m in again[:total]] == [m.data for m in stored]
    finally:
        for task in background:
            task.cancel()
        for c in clients:
            await c.close()


async def test_a_task_stream_gets_what_was_sent_while_its_server_was_lost(
    cluster: NatsCluster,
) -> None:
    """An API follows a task's chunks on plain subscriptions through server n1; n1 hangs, then
    dies, while the runner (on n0) publishes the rest. The API's connection moves to n2 and its
    stream still ends, with every chunk: what it missed is read from the streams."""
    api_nc = await connect(cluster.urls_from(1), name="api")
    runner_nc = await connect(cluster.urls_from(0), name="runner")
    try:
        await ensure_streams(runner_nc.jetstream(), StreamSettings(replicas=3))
        for stream in (EVENTS_STREAM, CHUNKS_STREAM):
            await make_leader(runner_nc, stream, "n0")
        task = TaskCreated(
            task_id="t1",
            model_id="m",
            origin="api",
            messages=[ChatMessage(role="user", content="hi")],
        )
        runner = Publisher(runner_nc.jetstream())

        def chunk(i: int) -> ChunkGenerated:
            return ChunkGenerated(
                task_id="t1",
                idx=i,
                text=f"<{i}>",
                origin="runner",
                finish_reason="stop" if i == 4 else None,
            )

        async with TaskStream(api_nc, task, "api", timeout_s=30) as ts:
            got = ts.chunks()
            await runner.publish(chunk(0))
            assert (await anext(got)).idx == 0
            server = cluster.servers[1]
            assert server._proc is not None
            os.kill(server._proc.pid, signal.SIGSTOP)  # hangs: what is routed to it is lost
            for i in range(1, 5):
                await runner.publish(chunk(i))
            done = TaskCompleted(
                task_id="t1",
                model_id="m",
                origin="runner",
                runner_id="r",
                finish_reason="stop",
                usage=Usage(prompt_tokens=1, completion_tokens=4),
                timings=Timings(ttft_ms=1, tokens_per_s=1, total_ms=1),
            )
            await runner.publish(done)
            server.kill()
            # Reading the streams makes a consumer, which waits for a JetStream meta leader when
            # n1 was it: an election, seconds longer on a loaded machine.
            async with asyncio.timeout(60):
                rest = [c.idx async for c in got]
        assert rest == [1, 2, 3, 4]
        assert ts.finished is not None and ts.finished.completed is not None
        assert api_nc.connected_url is not None and api_nc.connected_url.netloc != server.url
    finally:
        await api_nc.close()
        await runner_nc.close()


async def test_the_projection_stays_exact_when_its_consumer_leader_is_lost(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    """The projector's durable consumer (replicated like its stream) loses its leader while
    events pour in: the projection still equals a fold of the log, with no event skipped or
    applied out of order."""
    events = [e for e in history(n_tasks=150, seed=3) if e.type != "ChunkGenerated"]
    nc = await connect(cluster.urls_from(0), name="projector")
    pub_nc = await connect(cluster.urls_from(2), name="publisher")
    engine = database.create_engine(f"sqlite:///{tmp_path / 'projection.db'}")
    try:
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings(replicas=3))
        await make_leader(nc, EVENTS_STREAM, f"n{VICTIM}")
        third = len(events) // 3
        async with running_projector(js, engine, batch_size=2000) as projector:
            await _publish_paced(pub_nc, events[:third])
            await make_consumer_leader(nc, EVENTS_STREAM, "projector-main", f"n{VICTIM}")
            publishing = asyncio.create_task(_publish_paced(pub_nc, events[third:]))
            await asyncio.sleep(0.3)
            cluster.servers[VICTIM].kill()
            await publishing
            last = (await stream_info(nc, EVENTS_STREAM)).state.last_seq
            assert last == len(events)
            await wait_for_seq(projector, last, timeout=60)
        assert await db_rows(engine) == memory_rows(fold(events))
    finally:
        await engine.dispose()
        await nc.close()
        await pub_nc.close()


async def _publish_paced(nc: Client, events: Sequence[EventBase]) -> None:
    pub = Publisher(nc.jetstream())
    for e in events:
        await pub.publish(e)
        await asyncio.sleep(0)
