"""Durable pull consumers: parsed delivery, dead letters, one message to one replica, run()."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, DeliverPolicy, RawStreamMsg

from bus.consumer import (
    CONSUMER_HEADER,
    REASON_HEADER,
    SEQ_HEADER,
    STREAM_HEADER,
    SUBJECT_HEADER,
    EventConsumer,
)
from bus.publisher import Publisher
from bus.puller import ConsumerGone
from bus.streams import DEADLETTER_STREAM, EVENTS_STREAM
from events.catalogue import Event, NodeJoined, NodeLeft, TaskCreated

ALL_EVENTS = "shoal.events.>"

MakeConsumer = Callable[..., Awaitable[EventConsumer]]


@pytest.fixture
async def make_consumer(js: JetStreamContext) -> AsyncIterator[MakeConsumer]:
    """Starts EventConsumers on SHOAL_EVENTS and stops them after the test."""
    started: list[EventConsumer] = []

    async def make(
        durable: str = "test",
        filter_subject: str = ALL_EVENTS,
        *,
        recreate: bool = False,
        **kwargs: object,
    ) -> EventConsumer:
        c = EventConsumer(js, EVENTS_STREAM, durable, filter_subject, **kwargs)  # type: ignore[arg-type]
        await c.start(recreate=recreate)
        started.append(c)
        return c

    yield make
    for c in started:
        await c.stop()


async def _publish_nodes(js: JetStreamContext, *names: str) -> list[int]:
    pub = Publisher(js)
    return [(await pub.publish(NodeJoined(node_id=n, origin=n))).seq for n in names]


async def _info(js: JetStreamContext, durable: str = "test") -> ConsumerInfo:
    info: ConsumerInfo = await js.consumer_info(EVENTS_STREAM, durable)
    return info


async def _settled(js: JetStreamContext, durable: str = "test") -> ConsumerInfo:
    """Consumer info once no acks are outstanding (acks are fire-and-forget publishes, so the
    server may count them a moment later); the last info after 2 s otherwise."""
    deadline = time.monotonic() + 2.0
    while True:
        info = await _info(js, durable)
        if info.num_ack_pending == 0 or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.02)


async def _dead_letters(js: JetStreamContext) -> list[RawStreamMsg]:
    state = (await js.stream_info(DEADLETTER_STREAM)).state
    if state.messages == 0:
        return []
    return [
        await js.get_msg(DEADLETTER_STREAM, s) for s in range(state.first_seq, state.last_seq + 1)
    ]


def _node_ids(events: list[Event]) -> list[str]:
    out = []
    for e in events:
        assert isinstance(e, NodeJoined)
        out.append(e.node_id)
    return out


async def test_fetch_before_start_raises(js: JetStreamContext) -> None:
    c = EventConsumer(js, EVENTS_STREAM, "x", ALL_EVENTS)
    with pytest.raises(RuntimeError, match="not started"):
        await c.fetch()


async def test_a_waiting_fetch_ends_when_asked_to_stop_and_loses_nothing(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    c = await make_consumer()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    started = time.monotonic()
    assert await c.fetch(1, timeout=30.0, stop=stop) == []
    assert time.monotonic() - started < 5.0
    # The pull request was ended with it: what comes next is fetched, not taken by it.
    (seq,) = await _publish_nodes(js, "after")
    got = await c.fetch(1, timeout=5.0, stop=asyncio.Event())
    assert [d.stream_seq for d in got] == [seq]


async def test_more_takes_only_what_is_there_and_keeps_the_batch_together(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    c = await make_consumer()
    first = await _publish_nodes(js, "a", "b")
    got = await c.fetch(2, timeout=1.0)
    started = time.monotonic()
    assert await c.fetch(5, timeout=10.0, more=True) == []  # nothing there: no waiting
    assert time.monotonic() - started < 5.0
    second = await _publish_nodes(js, "c")
    # The publish is acknowledged once stored; the consumer learns of it a moment later (under
    # load, after a first no-wait fetch has found nothing), so ask again until it is there.
    deadline = time.monotonic() + 10.0
    while len(got) < 3 and time.monotonic() < deadline:
        got += await c.fetch(5, timeout=1.0, more=True)
    assert _node_ids([d.event for d in got]) == ["a", "b", "c"]
    assert c.fetched_seqs == [*first, *second] and c.last_stream_seq == second[0]


async def test_good_events_come_back_parsed_with_their_seq(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    pub = Publisher(js)
    events = [NodeJoined(node_id=f"n{i}", origin="t") for i in range(3)]
    seqs = [(await pub.publish(e)).seq for e in events]
    c = await make_consumer()
    got = await c.fetch(10, timeout=1.0)
    assert [d.event for d in got] == events
    assert [d.stream_seq for d in got] == seqs
    assert all(d.stored_at.tzinfo is not None for d in got)
    assert c.stats.delivered == 3 and c.stats.dead_letters == 0
    assert c.last_stream_seq == seqs[-1]
    # Explicit ack: nothing is done until it is acked.
    assert (await _info(js)).num_ack_pending == 3
    for d in got:
        await d.ack()
    info = await _settled(js)
    assert info.num_ack_pending == 0
    assert info.num_pending == 0
    assert info.ack_floor is not None and info.ack_floor.stream_seq == seqs[-1]


async def test_malformed_messages_are_dead_lettered_and_consumer_keeps_going(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    good1 = NodeJoined(node_id="good1", origin="t")
    good2 = NodeJoined(node_id="good2", origin="t")
    pub = Publisher(js)
    s_good1 = (await pub.publish(good1)).seq
    not_json = b"this is { not json"
    unknown = json.dumps({"type": "NodeExploded", "origin": "x", "node_id": "n"}).encode()
    invalid = json.dumps({"type": "NodeLeft", "origin": "x"}).encode()  # no node_id
    raw = [
        ("shoal.events.node.bad1.NodeJoined", not_json),
        ("shoal.events.node.bad2.NodeExploded", unknown),
        ("shoal.events.node.bad3.NodeLeft", invalid),
    ]
    bad_seqs = [(await js.publish(subject, data)).seq for subject, data in raw]
    s_good2 = (await pub.publish(good2)).seq

    c = await make_consumer("projector")
    got = await c.fetch(10, timeout=1.0)
    assert [d.event for d in got] == [good1, good2]
    assert [d.stream_seq for d in got] == [s_good1, s_good2]
    for d in got:
        await d.ack()
    assert c.last_stream_seq == s_good2

    assert c.stats.dead_letters == 3
    assert c.stats.delivered == 2
    assert c.stats.dead_letter_reasons == {
        "invalid JSON": 1,
        "unknown event type": 1,
        "invalid event": 1,
    }

    dead = await _dead_letters(js)
    assert len(dead) == 3
    reasons = []
    for msg, (subject, data), seq in zip(dead, raw, bad_seqs, strict=True):
        assert msg.subject == "shoal.deadletter.SHOAL_EVENTS"
        assert msg.data == data  # the payload is kept as it was
        assert msg.headers is not None
        assert msg.headers[SUBJECT_HEADER] == subject
        assert msg.headers[SEQ_HEADER] == str(seq)
        assert msg.headers[STREAM_HEADER] == EVENTS_STREAM
        assert msg.headers[CONSUMER_HEADER] == "projector"
        reasons.append(msg.headers[REASON_HEADER])
    assert reasons[0].startswith("invalid JSON")
    assert reasons[1] == "unknown event type: 'NodeExploded'"
    assert reasons[2].startswith("invalid event")
    assert "node_id" in reasons[2] and "required" in reasons[2].lower()
    assert len(set(reasons)) == 3

    # Terminated, not redelivered: nothing pending, nothing comes back.
    info = await _settled(js, "projector")
    assert info.num_ack_pending == 0
    assert info.num_redelivered == 0
    assert info.num_pending == 0
    assert await c.fetch(10, timeout=0.3) == []
    assert c.stats.dead_letters == 3
    assert (await js.stream_info(DEADLETTER_STREAM)).state.messages == 3

    # And it keeps going with what comes next.
    s_good3 = (await pub.publish(NodeJoined(node_id="good3", origin="t"))).seq
    (d3,) = await c.fetch(10, timeout=1.0)
    assert d3.stream_seq == s_good3


async def test_one_at_a_time_past_a_bad_message(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await js.publish("shoal.events.node.x.NodeJoined", b"\xff\xfe garbage")
    (s_good,) = await _publish_nodes(js, "after")
    c = await make_consumer()
    seen: list[int] = []
    for _ in range(3):
        for d in await c.fetch(1, timeout=0.5):
            seen.append(d.stream_seq)
            await d.ack()
        if seen:
            break
    assert seen == [s_good]
    assert c.stats.dead_letters == 1
    (dead,) = await _dead_letters(js)
    assert dead.headers is not None
    assert dead.headers[REASON_HEADER].startswith("invalid JSON")


async def test_message_without_type_is_dead_lettered(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await js.publish("shoal.events.node.x.NodeJoined", b'{"origin": "x", "node_id": "x"}')
    await js.publish("shoal.events.node.x.NodeJoined", b"[1, 2, 3]")
    c = await make_consumer()
    assert await c.fetch(10, timeout=0.3) == []
    assert c.stats.dead_letters == 2
    reasons = [m.headers[REASON_HEADER] for m in await _dead_letters(js) if m.headers]
    assert reasons[0] == "no 'type' field"
    assert reasons[1].startswith("invalid event")


async def test_same_bad_message_seen_by_two_consumers_is_one_dead_letter(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await js.publish("shoal.events.node.x.NodeJoined", b"nope")
    a = await make_consumer("projector")
    b = await make_consumer("planner")
    assert await a.fetch(5, timeout=0.3) == []
    assert await b.fetch(5, timeout=0.3) == []
    assert a.stats.dead_letters == b.stats.dead_letters == 1
    dead = await _dead_letters(js)
    assert len(dead) == 1
    assert dead[0].headers is not None and dead[0].headers[SEQ_HEADER] == "1"
    for durable in ("projector", "planner"):
        assert (await _settled(js, durable)).num_ack_pending == 0


async def test_two_replicas_on_one_durable_get_different_messages(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    seqs = await _publish_nodes(js, "t1", "t2", "t3")
    a = await make_consumer("replicas")
    b = await make_consumer("replicas")
    (da,) = await a.fetch(1, timeout=1.0)
    (db,) = await b.fetch(1, timeout=1.0)
    assert da.stream_seq != db.stream_seq
    assert {da.stream_seq, db.stream_seq} == set(seqs[:2])
    info = await _info(js, "replicas")
    assert info.num_ack_pending == 2  # each replica holds exactly the one it took
    await da.ack()
    await db.ack()
    (dc,) = await a.fetch(1, timeout=1.0)
    assert dc.stream_seq == seqs[2]
    await dc.ack()
    assert await b.fetch(1, timeout=0.3) == []
    assert (await _settled(js, "replicas")).num_ack_pending == 0


async def test_busy_replica_does_not_block_an_idle_one(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    busy = await make_consumer("replicas")
    idle = await make_consumer("replicas")
    s1, s2 = await _publish_nodes(js, "t1", "t2")
    (d1,) = await busy.fetch(1, timeout=1.0)  # busy takes one and is working on it
    assert d1.stream_seq == s1
    (d2,) = await idle.fetch(1, timeout=1.0)  # the idle one takes the next
    assert d2.stream_seq == s2
    await d1.ack()
    await d2.ack()


async def test_idle_consumer_holds_no_messages(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    idle = await make_consumer("replicas")
    started = time.monotonic()
    assert await idle.fetch(1, timeout=0.3) == []
    assert time.monotonic() - started < 2.0
    # Its expired request must not catch what is published afterwards.
    (seq,) = await _publish_nodes(js, "later")
    await asyncio.sleep(0.1)
    info = await _info(js, "replicas")
    assert info.num_ack_pending == 0
    assert info.num_pending == 1
    assert info.num_waiting == 0
    other = await make_consumer("replicas")
    (d,) = await other.fetch(1, timeout=1.0)
    assert d.stream_seq == seq
    await d.ack()


async def test_fetch_batch_takes_only_what_it_asked_for(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await _publish_nodes(js, *[f"n{i}" for i in range(10)])
    c = await make_consumer()
    got = await c.fetch(4, timeout=1.0)
    assert [d.stream_seq for d in got] == [1, 2, 3, 4]
    info = await _info(js)
    assert info.num_ack_pending == 4
    assert info.num_pending == 6
    rest = await c.fetch(100, timeout=1.0)
    assert [d.stream_seq for d in rest] == list(range(5, 11))


@pytest.mark.parametrize("timeout", [0.2, 0.6])
async def test_fetch_returns_empty_within_timeout(
    make_consumer: MakeConsumer, timeout: float
) -> None:
    c = await make_consumer()
    started = time.monotonic()
    assert await c.fetch(5, timeout=timeout) == []
    elapsed = time.monotonic() - started
    assert elapsed < timeout + 0.5
    assert c.stats.delivered == 0


async def test_waiting_fetch_returns_when_a_message_arrives(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    c = await make_consumer()
    fetch = asyncio.create_task(c.fetch(1, timeout=5.0))
    await asyncio.sleep(0.2)
    assert not fetch.done()
    started = time.monotonic()
    (seq,) = await _publish_nodes(js, "wake")
    got = await asyncio.wait_for(fetch, 5.0)
    assert time.monotonic() - started < 1.0
    assert [d.stream_seq for d in got] == [seq]


async def test_filter_subject_selects_one_models_tasks(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    pub = Publisher(js)
    mine = TaskCreated(task_id="t1", model_id="Qwen2.5-0.5B", origin="api")
    await pub.publish(TaskCreated(task_id="t0", model_id="smollm2-135m", origin="api"))
    await pub.publish(mine)
    await pub.publish(NodeJoined(node_id="n", origin="n"))
    c = await make_consumer("runners-qwen", TaskCreated.filter_for("Qwen2.5-0.5B"))
    got = await c.fetch(10, timeout=0.5)
    assert [d.event for d in got] == [mine]


async def test_unacked_message_is_redelivered_after_ack_wait(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    (seq,) = await _publish_nodes(js, "n")
    crashed = await make_consumer("replicas", ack_wait=0.5)
    (d,) = await crashed.fetch(1, timeout=1.0)
    assert d.msg.metadata.num_delivered == 1
    await crashed.stop()  # "crashes" without acking
    survivor = await make_consumer("replicas", ack_wait=0.5)
    (again,) = await survivor.fetch(1, timeout=3.0)
    assert again.stream_seq == seq
    assert again.msg.metadata.num_delivered == 2
    await again.ack()


async def test_durable_position_survives_restart(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    seqs = await _publish_nodes(js, "a", "b", "c", "d")
    first = await make_consumer("projector")
    for d in await first.fetch(2, timeout=1.0):
        await d.ack()
    await first.stop()
    second = await make_consumer("projector")  # binds to the same durable
    got = await second.fetch(10, timeout=1.0)
    assert [d.stream_seq for d in got] == seqs[2:]


async def test_recreate_with_opt_start_seq_starts_there(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await _publish_nodes(js, *[f"n{i}" for i in range(1, 7)])
    c = await make_consumer("projector")
    for d in await c.fetch(10, timeout=1.0):
        await d.ack()
    await c.stop()

    # Without recreate the existing durable (and its position) is kept.
    kept = await make_consumer(
        "projector", deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=3
    )
    assert await kept.fetch(10, timeout=0.3) == []
    await kept.stop()

    fresh = await make_consumer(
        "projector",
        recreate=True,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=4,
    )
    got = await fresh.fetch(10, timeout=1.0)
    assert [d.stream_seq for d in got] == [4, 5, 6]
    assert _node_ids([d.event for d in got]) == ["n4", "n5", "n6"]
    info = await _info(js, "projector")
    assert info.config.opt_start_seq == 4


async def test_recreate_when_no_consumer_exists(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await _publish_nodes(js, "a", "b")
    c = await make_consumer("new", recreate=True)
    assert [d.stream_seq for d in await c.fetch(10, timeout=1.0)] == [1, 2]


async def test_run_naks_then_dead_letters_a_failing_event(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    pub = Publisher(js)
    for n in ("g1", "poison", "g2", "g3"):
        await pub.publish(NodeJoined(node_id=n, origin="t"))
    poison_seq = 2
    handled: list[str] = []
    attempts: list[str] = []

    async def handle(event: Event) -> None:
        assert isinstance(event, NodeJoined)
        attempts.append(event.node_id)
        if event.node_id == "poison":
            raise ValueError("cannot apply poison")
        handled.append(event.node_id)

    c = await make_consumer("runner")
    run = asyncio.create_task(c.run(handle, stop_after=4, max_attempts=3))
    deadline = time.monotonic() + 10
    while c.stats.dead_letters == 0 and time.monotonic() < deadline:
        assert not run.done()
        await asyncio.sleep(0.05)
    assert c.stats.dead_letters == 1
    assert handled == ["g1", "g2", "g3"]  # the poison did not hold the others up
    assert attempts.count("poison") == 3  # nak'ed and redelivered until max_attempts
    assert not run.done()  # 3 of 4 handled: still running

    await pub.publish(NodeJoined(node_id="g4", origin="t"))
    await asyncio.wait_for(run, 10)
    assert handled == ["g1", "g2", "g3", "g4"]
    assert attempts.count("poison") == 3  # not redelivered after being dead-lettered

    (dead,) = await _dead_letters(js)
    assert dead.headers is not None
    reason = dead.headers[REASON_HEADER]
    assert reason.startswith("handler error")
    assert "cannot apply poison" in reason
    assert dead.headers[SEQ_HEADER] == str(poison_seq)
    assert dead.headers[CONSUMER_HEADER] == "runner"
    assert c.stats.dead_letter_reasons == {"handler error": 1}
    info = await _settled(js, "runner")
    assert info.num_ack_pending == 0
    assert info.num_pending == 0
    assert await c.fetch(1, timeout=0.2) == []


async def test_run_with_one_attempt_dead_letters_at_once(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await _publish_nodes(js, "bad", "ok")
    seen: list[str] = []

    async def handle(event: Event) -> None:
        assert isinstance(event, NodeJoined)
        seen.append(event.node_id)
        if event.node_id == "bad":
            raise RuntimeError("boom")

    c = await make_consumer()
    await asyncio.wait_for(c.run(handle, stop_after=1, max_attempts=1), 5)
    assert seen == ["bad", "ok"]
    assert c.stats.dead_letters == 1
    assert (await _settled(js)).num_ack_pending == 0


async def test_run_acks_each_handled_event(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    await _publish_nodes(js, "a", "b", "c")
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    c = await make_consumer()
    await asyncio.wait_for(c.run(handle, stop_after=3), 5)
    assert _node_ids(seen) == ["a", "b", "c"]
    info = await _settled(js)
    assert info.num_ack_pending == 0
    assert info.ack_floor is not None and info.ack_floor.stream_seq == 3


async def test_run_can_be_cancelled_while_idle(make_consumer: MakeConsumer) -> None:
    async def handle(event: Event) -> None:
        raise AssertionError("no events expected")

    c = await make_consumer()
    run = asyncio.create_task(c.run(handle))
    await asyncio.sleep(0.2)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert c.stats.delivered == 0


async def test_dead_letter_keeps_other_event_types_untouched(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    """A NodeLeft with a wrong field type is dead-lettered; valid events of the same type pass."""
    bad = json.dumps({"type": "NodeLeft", "origin": "x", "node_id": ["not", "a", "str"]})
    await js.publish("shoal.events.node.x.NodeLeft", bad.encode())
    ok = NodeLeft(node_id="y", origin="y")
    await Publisher(js).publish(ok)
    c = await make_consumer()
    got = await c.fetch(10, timeout=0.5)
    assert [d.event for d in got] == [ok]
    (dead,) = await _dead_letters(js)
    assert dead.headers is not None
    assert "node_id" in dead.headers[REASON_HEADER]


async def test_stopped_consumer_holds_nothing_published_later(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    async def handle(event: Event) -> None:
        raise AssertionError("no events expected")

    c = await make_consumer("replicas")
    run = asyncio.create_task(c.run(handle))  # leaves a 5 s pull request waiting
    await asyncio.sleep(0.2)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await c.stop()
    (seq,) = await _publish_nodes(js, "t1")
    await asyncio.sleep(0.2)
    info = await _info(js, "replicas")
    assert info.num_ack_pending == 0  # the server saw nobody listening on the inbox
    assert info.num_pending == 1
    other = await make_consumer("replicas")
    (d,) = await other.fetch(1, timeout=1.0)
    assert d.stream_seq == seq


async def test_cancelled_run_holds_nothing_published_later(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    async def handle(event: Event) -> None:
        raise AssertionError("no events expected")

    c = await make_consumer("replicas")
    run = asyncio.create_task(c.run(handle))
    await asyncio.sleep(0.2)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await _publish_nodes(js, "t1")
    await asyncio.sleep(0.2)
    assert (await _info(js, "replicas")).num_ack_pending == 0


async def test_a_deleted_consumer_is_reported_gone(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    """Deleted while a pull waits (409 Consumer Deleted), or before one (503, nobody answers):
    ``ConsumerGone`` either way, not an empty fetch that the caller would repeat forever."""
    c = await make_consumer("gone")
    waiting = asyncio.create_task(c.fetch(1, timeout=5.0))
    await asyncio.sleep(0.2)
    await js.delete_consumer(EVENTS_STREAM, "gone")
    with pytest.raises(ConsumerGone):
        await asyncio.wait_for(waiting, 3.0)
    with pytest.raises(ConsumerGone):
        await c.fetch(1, timeout=1.0)


async def test_a_memory_consumer_keeps_its_position_in_memory(
    js: JetStreamContext, make_consumer: MakeConsumer
) -> None:
    seqs = await _publish_nodes(js, "a", "b")
    c = await make_consumer("in-memory", memory=True)
    assert (await _info(js, "in-memory")).config.mem_storage is True
    assert [d.stream_seq for d in await c.fetch(5, timeout=1.0)] == seqs
    await make_consumer("on-file")
    assert not (await _info(js, "on-file")).config.mem_storage
