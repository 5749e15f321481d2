"""The SQL projector against a real nats-server and real SQLite / PostgreSQL."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import fields

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from sqlalchemy import Connection, inspect
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.consumer import Delivered, EventConsumer
from bus.streams import EVENTS_STREAM
from events.catalogue import Event, NodeJoined, TaskCreated
from events.records import ChatMessage
from events.subjects import EVENTS_PREFIX
from harness.history import history
from projectors import database
from projectors.database import MIGRATIONS_DIR, ProjectorRunning, projector_hold
from projectors.projector import ProjectionGap, Projector, counted
from projectors.replay import replay
from projectors.rows import ROW_TYPES
from projectors.rules import fold
from projectors.store import (
    OffsetConflict,
    Progress,
    load_state,
    read_counts,
    read_offset,
    read_progress,
    write_offset,
)
from projectors.tables import STATE_TABLES, metadata
from tests.conftest import MakeDb
from tests.projectors.helpers import (
    db_rows,
    memory_rows,
    publish_all,
    running_projector,
    wait_for_seq,
)


def task(task_id: str) -> TaskCreated:
    return TaskCreated(
        task_id=task_id, model_id="m", origin="t", messages=[ChatMessage(role="user", content="hi")]
    )


def log_events(n_tasks: int, seed: int = 1) -> list[Event]:
    """The part of a history that goes to the events stream (chunks have their own)."""
    return [e for e in history(n_tasks=n_tasks, seed=seed) if e.type != "ChunkGenerated"]


def test_rows_and_tables_have_the_same_columns() -> None:
    for row_type in ROW_TYPES:
        table = STATE_TABLES[row_type.TABLE]
        assert {f.name for f in fields(row_type)} == {c.name for c in table.columns}


async def test_migrations_create_exactly_the_tables(engine: AsyncEngine) -> None:
    await database.upgrade(engine)
    await database.upgrade(engine)  # idempotent
    newest = max(p.name[:4] for p in (MIGRATIONS_DIR / "versions").glob("0*.py"))
    assert await database.current_revision(engine) == newest

    def diff(conn: Connection) -> list[object]:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, metadata))

    async with engine.connect() as conn:
        assert await conn.run_sync(diff) == []
        names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    tracking = {"projector_offsets", "projector_event_counts", "alembic_version"}
    assert set(STATE_TABLES) | tracking == names


async def test_a_projection_from_an_older_schema_upgrades_with_its_rows(
    engine: AsyncEngine,
) -> None:
    await database.upgrade(engine, "0001")
    async with engine.begin() as conn:
        await conn.execute(
            STATE_TABLES["models"].insert(),
            [
                {
                    "model_id": "m",
                    "n_layers": 2,
                    "size_bytes": 9,
                    "family": "",
                    "context_length": 0,
                    "source": "",
                }
            ],
        )
    await database.upgrade(engine)
    async with engine.connect() as conn:
        state = await load_state(conn)
    model = state.model("m")
    assert model is not None and (model.size_bytes, model.kv_bytes_per_token) == (9, 0)


async def test_projection_equals_the_pure_fold(js: JetStreamContext, engine: AsyncEngine) -> None:
    events = log_events(n_tasks=60)
    last = await publish_all(js, events)
    async with running_projector(js, engine, batch_size=100) as projector:
        await wait_for_seq(projector, last)
    assert await db_rows(engine) == memory_rows(fold(events))
    async with engine.connect() as conn:
        assert await read_offset(conn, "main", EVENTS_STREAM) == last


async def test_restart_resumes_where_it_stopped(js: JetStreamContext, engine: AsyncEngine) -> None:
    events = log_events(n_tasks=80)
    half = len(events) // 2
    first = await publish_all(js, events[:half])
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, first)
    last = await publish_all(js, events[half:])
    async with running_projector(js, engine) as projector:
        assert projector.applied_seq >= first  # resumed from the tracking row, not from 0
        await wait_for_seq(projector, last)
    assert await db_rows(engine) == memory_rows(fold(events))


async def test_redelivered_events_change_nothing(js: JetStreamContext, engine: AsyncEngine) -> None:
    events = log_events(n_tasks=30)
    last = await publish_all(js, events)
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, last)
        before = await db_rows(engine)
        # Deliver the whole log again, as a broker redelivery would, through the same path.
        again = EventConsumer(js, EVENTS_STREAM, "redeliver", f"{EVENTS_PREFIX}.>", ack_all=True)
        await again.start()
        batch = await again.fetch(10_000, timeout=2.0)
        assert len(batch) == last
        await projector.apply_batch(batch, again)
        await again.stop()
        assert await db_rows(engine) == before
        assert projector.applied_seq == last


async def test_events_after_a_hole_are_not_applied(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """As when a consumer leader's server is lost with messages on the way: newer ones arrive
    first, the lost ones only after the ack wait. Nothing after the hole is applied; what came
    whole, in any order, is applied in stream order."""
    events = log_events(n_tasks=10)
    last = await publish_all(js, events)
    await database.upgrade(engine)
    projector = Projector(js, engine)

    async def fetched(name: str, start: int) -> tuple[EventConsumer, list[Delivered]]:
        consumer = EventConsumer(
            js,
            EVENTS_STREAM,
            name,
            f"{EVENTS_PREFIX}.>",
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_all=True,  # as the projector's own
        )
        await consumer.start()
        return consumer, await consumer.fetch(10_000, timeout=2.0)

    skipping, batch = await fetched("skipping", 3)
    with pytest.raises(ProjectionGap, match="seq 2 was not delivered"):
        await projector.apply_batch(batch, skipping)
    assert projector.applied_seq == 0
    assert all(rows == [] for rows in (await db_rows(engine)).values())

    whole, batch = await fetched("whole", 1)
    await projector.apply_batch(list(reversed(batch)), whole)
    assert projector.applied_seq == last
    assert await db_rows(engine) == memory_rows(fold(events))

    # A message the stream no longer holds (aged out, removed) leaves no hole to wait for.
    more = [NodeJoined(node_id=f"late-{i}", origin="t") for i in range(3)]
    await publish_all(js, more)
    await js.delete_msg(EVENTS_STREAM, last + 2)
    after, batch = await fetched("after", last + 1)
    await projector.apply_batch(batch, after)
    assert projector.applied_seq == last + 3
    assert await db_rows(engine) == memory_rows(fold([*events, more[0], more[2]]))
    for c in (skipping, whole, after):
        await c.stop()


class BatchSizes(Projector):
    """A projector that notes the size of each batch it writes."""

    sizes: list[int]

    async def apply_batch(self, batch: list[Delivered], consumer: EventConsumer) -> None:
        self.sizes = [*getattr(self, "sizes", []), len(batch)]
        await super().apply_batch(batch, consumer)


async def test_task_events_wait_for_company_cluster_events_do_not(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """A batch of task events only waits task_linger_s for more, and is written with them;
    one that steers the cluster is written as it comes."""
    await database.upgrade(engine)
    projector = BatchSizes(js, engine, task_linger_s=1.0)
    stop = asyncio.Event()
    running = asyncio.create_task(projector.run(stop))
    try:
        await asyncio.wait_for(projector.ready.wait(), 30)
        loop = asyncio.get_running_loop()
        projector.sizes = []
        started = loop.time()
        await publish_all(js, [task("t1")])
        await asyncio.sleep(0.3)
        last = await publish_all(js, [task("t2")])
        await wait_for_seq(projector, last)
        assert loop.time() - started >= 1.0 and projector.sizes == [2]

        started = loop.time()
        last = await publish_all(js, [NodeJoined(node_id="n", origin="t")])
        await wait_for_seq(projector, last)
        assert loop.time() - started < 0.8 and projector.sizes == [2, 1]
        rows = await db_rows(engine)
        assert [r["task_id"] for r in rows["tasks"]] == ["t1", "t2"]
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)


async def test_malformed_events_are_set_aside(
    nc: Client, js: JetStreamContext, engine: AsyncEngine
) -> None:
    good = log_events(n_tasks=10)
    await publish_all(js, good[:5])
    await js.publish(f"{EVENTS_PREFIX}.node.x.NodeJoined", b"{not json")
    await js.publish(f"{EVENTS_PREFIX}.node.x.Mystery", b'{"type": "Mystery"}')
    await js.publish(f"{EVENTS_PREFIX}.node.x.NodeJoined", b'{"type": "NodeJoined"}')
    last = await publish_all(js, good[5:])
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, last)
        assert projector.consumer is not None
        assert projector.consumer.stats.dead_letters == 3
    assert await db_rows(engine) == memory_rows(fold(good))
    dead = await js.stream_info("SHOAL_DEADLETTER")
    assert dead.state.messages == 3


async def test_a_database_reset_is_noticed(js: JetStreamContext, make_db: MakeDb) -> None:
    """The database, not the consumer, says where the projector stands: a new, empty database
    given to a projector whose durable consumer already acked everything gets the whole log."""
    events = log_events(n_tasks=20)
    last = await publish_all(js, events)
    for url in (await make_db(), await make_db()):
        engine = database.create_engine(url)
        try:
            async with running_projector(js, engine) as projector:
                await wait_for_seq(projector, last)
            assert await db_rows(engine) == memory_rows(fold(events))
        finally:
            await engine.dispose()


async def test_one_event_gives_one_row(js: JetStreamContext, engine: AsyncEngine) -> None:
    last = await publish_all(js, [NodeJoined(node_id="solo", origin="solo", hostname="h")])
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, last)
    rows = await db_rows(engine)
    assert [(r["node_id"], r["hostname"], r["status"]) for r in rows["nodes"]] == [
        ("solo", "h", "online")
    ]


async def test_a_lost_consumer_is_made_again_from_the_database(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """The projector's consumer lives in the server's memory: lost (here deleted; in life, a
    restarted nats-server), it is made again from the offset in the database."""
    events = log_events(n_tasks=20)
    half = len(events) // 2
    first = await publish_all(js, events[:half])
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, first)
        info = await js.consumer_info(EVENTS_STREAM, "projector-main")
        assert info.config.mem_storage is True
        await js.delete_consumer(EVENTS_STREAM, "projector-main")
        last = await publish_all(js, events[half:])
        await wait_for_seq(projector, last)
    assert await db_rows(engine) == memory_rows(fold(events))


def test_a_batch_s_subjects_count_by_type() -> None:
    subjects = [
        "shoal.events.node.a.NodeJoined",
        "shoal.events.node.b.NodeJoined",
        "shoal.events.node.a.Mystery",
        "shoal.events.task.m.t.TaskCreated",
    ]
    assert counted({"NodeJoined": 3, "NodeLeft": 1}, subjects) == {
        "NodeJoined": 5,
        "TaskCreated": 1,
    }
    assert counted({"NodeJoined": 3}, []) == {}


async def test_events_are_counted_by_type_with_their_rows(
    js: JetStreamContext, make_db: MakeDb
) -> None:
    """Counted by subject as they are applied, malformed ones too, in the commit of their
    rows; a replay counts the same."""
    good = log_events(n_tasks=10)
    await publish_all(js, good[:5])
    bad = [
        (f"{EVENTS_PREFIX}.node.x.NodeJoined", b"{not json"),
        (f"{EVENTS_PREFIX}.node.x.Mystery", b'{"type": "Mystery"}'),
        (f"{EVENTS_PREFIX}.task.m.t.TaskFailed", b'{"type": "TaskFailed"}'),
    ]
    for subject, data in bad:
        await js.publish(subject, data)
    last = await publish_all(js, good[5:])
    expected = Counter(e.type for e in good) + Counter({"NodeJoined": 1, "TaskFailed": 1})

    live = database.create_engine(await make_db())
    replayed = database.create_engine(await make_db())
    try:
        async with running_projector(js, live, batch_size=7) as projector:
            await wait_for_seq(projector, last)
            assert projector.counts == expected
        async with live.connect() as conn:
            assert await read_counts(conn, "main", EVENTS_STREAM) == expected
            progress = await read_progress(conn, EVENTS_STREAM)
        assert progress == {"main": Progress(last, dict(expected))}
        await replay(js, replayed)
        async with replayed.connect() as conn:
            assert await read_counts(conn, "main", EVENTS_STREAM) == expected
    finally:
        await live.dispose()
        await replayed.dispose()


async def test_the_tracking_row_moves_by_compare_and_set(engine: AsyncEngine) -> None:
    await database.upgrade(engine)
    async with engine.begin() as conn:
        await write_offset(conn, "p", EVENTS_STREAM, 5, 0)
    for seq, expected in ((9, 0), (9, 4)):  # a first write again; a writer that is behind
        with pytest.raises(OffsetConflict, match="is at 5, not at"):
            async with engine.begin() as conn:
                await write_offset(conn, "p", EVENTS_STREAM, seq, expected)
    async with engine.begin() as conn:
        await write_offset(conn, "p", EVENTS_STREAM, 9, 5)
        await write_offset(conn, "other", EVENTS_STREAM, 2, 0)  # another name: its own row
    async with engine.connect() as conn:
        assert await read_offset(conn, "p", EVENTS_STREAM) == 9


async def test_a_projector_behind_the_tracking_row_writes_nothing(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """As a second projector on the same database would be: it read the tracking row before
    the first one moved it. Its commit fails and changes nothing."""
    events = log_events(n_tasks=10)
    half = len(events) // 2
    first = await publish_all(js, events[:half])
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, first)
    before = await db_rows(engine)
    behind = Projector(js, engine)  # applied_seq 0: it has not seen the first one's commits
    last = await publish_all(js, events[half:])
    consumer = EventConsumer(js, EVENTS_STREAM, "behind", f"{EVENTS_PREFIX}.>")
    await consumer.start()
    try:
        batch = await consumer.fetch(10_000, timeout=2.0)
        assert len(batch) == last
        with pytest.raises(OffsetConflict, match=f"is at {first}, not at 0"):
            await behind.apply_batch(batch, consumer)
    finally:
        await consumer.stop()
    assert await db_rows(engine) == before
    async with engine.connect() as conn:
        assert await read_offset(conn, "main", EVENTS_STREAM) == first
        assert sum((await read_counts(conn, "main", EVENTS_STREAM)).values()) == first


async def test_one_projector_of_a_name_holds_a_database(engine: AsyncEngine) -> None:
    async with projector_hold(engine, "main"):
        with pytest.raises(ProjectorRunning, match="'main' already runs"):
            async with projector_hold(engine, "main", wait_s=0.3):
                pass
        async with projector_hold(engine, "other", wait_s=0.3):
            pass
    async with projector_hold(engine, "main", wait_s=0.3):  # let go
        pass
