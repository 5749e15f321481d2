"""Fuzzing the projector: whatever lands on ``shoal.events.>``, the projection keeps up.

The messages are those of tests/bus/test_consumer_fuzz.py (valid events, bad messages of every
kind, payloads near 1 MiB), plus valid events whose values the projection cannot store on SQLite
and PostgreSQL alike (a time without a zone or out of range, numbers beyond their column's 32 or
64 bits, strings longer than their column or holding NUL). Each example publishes them raw on a
real nats-server, runs the real Projector (projectors/projector.py, batches of a drawn size)
over them against a real database (SQLite, and PostgreSQL when ``SHOAL_TEST_POSTGRES_URL`` is
set), and checks:

- the projector keeps running: it reaches the last sequence, and an event published afterwards
  is applied too;
- the projection (rows read back from the database, and the projector's memory) equals the pure
  fold (``projectors.rules.fold``) of the valid, storable events, in order;
- every bad message, and every unstorable event, is in SHOAL_DEADLETTER exactly once with a
  reason naming the problem ("cannot be stored: nodes.hostname: ..." for the latter); the
  projector's consumer counted each once, and so does ``/metrics``;
- ``shoal replay`` of the same log into an empty database gives the same rows, skipping the same
  messages.

One nats-server and two databases (live, replay) per test function; each example purges the
streams and empties the databases first.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM
from events.catalogue import Event, NodeJoined, subject_event_type
from projectors import database
from projectors.projector import DEFAULT_NAME, Projector
from projectors.replay import replay
from projectors.rules import fold
from projectors.store import read_counts
from projectors.tables import STATE_TABLES, event_counts, projector_offsets
from tests.bus.test_consumer_fuzz import (
    FUZZ_SETTINGS,
    MESSAGES,
    Message,
    Published,
    check_dead_letters,
    dead_letters,
    logged_dead_letters,
    metrics_dead_letters,
    publish,
)
from tests.conftest import MakeDb
from tests.projectors.helpers import db_rows, live_part, memory_rows, wait_for_seq

CATCH_UP_S = 20.0  # the projector takes well under a second; more means it is stuck


@pytest.fixture
async def engines(make_db: MakeDb) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    """Two databases (live projection, replay) for all the examples of a test function."""
    live = database.create_engine(await make_db())
    rebuilt = database.create_engine(await make_db())
    yield live, rebuilt
    await live.dispose()
    await rebuilt.dispose()


async def empty(engine: AsyncEngine) -> None:
    await database.upgrade(engine)
    async with engine.begin() as conn:
        for table in (*STATE_TABLES.values(), projector_offsets, event_counts):
            await conn.execute(delete(table))


async def counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return await read_counts(conn, DEFAULT_NAME, EVENTS_STREAM)


@asynccontextmanager
async def running(
    js: JetStreamContext, engine: AsyncEngine, batch_size: int
) -> AsyncIterator[tuple[Projector, asyncio.Task[None]]]:
    projector = Projector(js, engine, batch_size=batch_size)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        async with asyncio.timeout(30):
            await projector.ready.wait()
        yield projector, task
    finally:
        stop.set()
        await task


def dead_expected(published: Published) -> list[tuple[Message, int, str, tuple[str, ...]]]:
    """What the projector must set aside: bad messages, and valid events it cannot store."""
    out = []
    for m, seq in zip(published.messages, published.seqs, strict=True):
        if m.bad:
            out.append((m, seq, m.reasons[0], m.mentions))
        elif m.unstorable:
            out.append((m, seq, "cannot be stored", (m.unstorable,)))
    return out


# A projector start and stop per example (about 0.6 s), twice with PostgreSQL: fewer examples.
@settings(FUZZ_SETTINGS, max_examples=30)
@given(messages=MESSAGES, batch_size=st.integers(1, 8))
async def test_projection_equals_the_fold_of_the_valid_events_and_bad_ones_are_set_aside(
    nc: Client,
    js: JetStreamContext,
    engines: tuple[AsyncEngine, AsyncEngine],
    messages: list[Message],
    batch_size: int,
) -> None:
    live, rebuilt = engines
    await empty(live)
    await empty(rebuilt)
    published = await publish(nc, js, messages)
    applied = [cast(Event, m.event) for m in messages if m.event is not None and not m.unstorable]
    set_aside = dead_expected(published)

    with logged_dead_letters() as lines:
        async with running(js, live, batch_size) as (projector, task):
            await wait_for_seq(projector, published.last_seq, CATCH_UP_S)
            assert not task.done()
            # Still alive: what comes next is applied too.
            after = NodeJoined(node_id="after", origin="fuzz")
            seq = (await Publisher(js).publish(after)).seq
            await wait_for_seq(projector, seq, CATCH_UP_S)
            assert projector.consumer is not None
            stats = projector.consumer.stats
            memory = memory_rows(projector.state)

    expected = memory_rows(fold([*applied, after]))
    assert await db_rows(live) == expected
    assert memory == live_part(expected)
    check_dead_letters(await dead_letters(js), set_aside, "projector-main")
    assert stats.dead_letters == len(set_aside)
    assert len([line for line in lines if line.startswith("dead-lettered")]) == len(set_aside)
    assert await metrics_dead_letters(js) == len(set_aside)

    result = await replay(js, rebuilt)
    assert (result.applied, result.skipped, result.last_seq) == (
        len(applied) + 1,
        len(set_aside),
        seq,
    )
    assert await db_rows(rebuilt) == expected
    # Counted by subject as stored, malformed or not, alike live and in a replay.
    stored = [m.subject for m, s in zip(published.messages, published.seqs, strict=True) if s]
    by_type = Counter(t for s in [*stored, after.subject] if (t := subject_event_type(s)))
    assert [await counts(e) for e in (live, rebuilt)] == [by_type, by_type]
