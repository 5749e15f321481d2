"""Shared steps of the projector tests: publish a history, run a projector, read rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import MSG_ID_HEADER
from bus.streams import EVENTS_STREAM
from events.catalogue import EventBase
from events.states import TASK_ENDED
from projectors import database
from projectors.projector import Projector
from projectors.rows import ResponseRow, TaskRow
from projectors.state import ClusterState
from projectors.store import row_values, table_rows
from projectors.tables import STATE_TABLES


async def publish_all(js: JetStreamContext, events: Iterable[EventBase]) -> int:
    """Publish with pipelined acks; returns the events stream's last sequence."""
    futures = []
    for e in events:
        fut = await js.publish_async(e.subject, e.to_json(), headers={MSG_ID_HEADER: e.event_id})
        futures.append(fut)
    await asyncio.gather(*futures)
    return (await js.stream_info(EVENTS_STREAM)).state.last_seq


async def wait_for_seq(projector: Projector, seq: int, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while projector.applied_seq < seq:
            await asyncio.sleep(0.02)


@asynccontextmanager
async def running_projector(
    js: JetStreamContext, engine: AsyncEngine, **kw: Any
) -> AsyncIterator[Projector]:
    projector = Projector(js, engine, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(projector.run(stop))
    try:
        async with asyncio.timeout(30):
            await projector.ready.wait()
        yield projector
    finally:
        stop.set()
        await task


async def db_rows(engine: AsyncEngine) -> dict[str, list[dict[str, Any]]]:
    async with engine.connect() as conn:
        return {name: await table_rows(conn, name) for name in STATE_TABLES}


async def db_rows_of(url: str) -> dict[str, list[dict[str, Any]]]:
    engine = database.create_engine(url)
    try:
        return await db_rows(engine)
    finally:
        await engine.dispose()


def live_part(rows: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """What a projector holds in memory of these rows (``projectors/residency.py``): all but
    ended tasks and stored responses."""
    return rows | {
        TaskRow.TABLE: [r for r in rows[TaskRow.TABLE] if r["status"] not in TASK_ENDED],
        ResponseRow.TABLE: [],
    }


def memory_rows(state: ClusterState) -> dict[str, list[dict[str, Any]]]:
    """The in-memory state in the shape `db_rows` gives, for comparing the two."""
    return {
        name: [row_values(r) for _, r in sorted(state.tables[name].items())]
        for name in STATE_TABLES
    }
