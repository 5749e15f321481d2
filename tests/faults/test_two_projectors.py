"""Two `shoal projector` processes of the same name on one database: the second fails at once,
saying why, without touching the first one's consumer; the first goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.embedded import EmbeddedNats
from bus.streams import EVENTS_STREAM
from harness.history import history
from harness.processes import Processes
from projectors import database
from projectors.rules import fold
from projectors.store import read_offset
from tests.conftest import MakeDb
from tests.projectors.helpers import db_rows, memory_rows, publish_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def _applied(engine: AsyncEngine, seq: int) -> None:
    async with asyncio.timeout(60):
        while True:
            async with engine.connect() as conn:
                if await read_offset(conn, "main", EVENTS_STREAM) == seq:
                    return
            await asyncio.sleep(0.05)


async def test_a_second_projector_fails_and_the_first_goes_on(
    nats_server: EmbeddedNats, js: JetStreamContext, make_db: MakeDb, tmp_path: Path
) -> None:
    events = [e for e in history(n_tasks=30, seed=5) if e.type != "ChunkGenerated"]
    half = len(events) // 2
    db_url = await make_db()
    args = ("projector", "--nats", nats_server.url, "--db", db_url, "--name", "main")
    engine = database.create_engine(db_url)
    try:
        with Processes(tmp_path / "logs") as procs:
            first = procs.start("first", *args)
            await procs.wait_log("first", "resuming after seq")
            await _applied(engine, await publish_all(js, events[:half]))

            second = procs.start("second", *args)
            assert await asyncio.to_thread(second.wait, 60) == 1
            assert "projector 'main' already runs" in procs.log("second")

            await _applied(engine, await publish_all(js, events[half:]))
            assert first.poll() is None
            # Never disturbed: no consumer lost, nothing resumed from the last commit.
            assert "projector error" not in procs.log("first")
            assert procs.log("first").count("resuming after seq") == 1
        assert first.returncode == 0
        assert await db_rows(engine) == memory_rows(fold(events))
    finally:
        await engine.dispose()
