"""Replay: a fresh projection from the log equals the live one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.embedded import EmbeddedNats
from bus.streams import EVENTS_STREAM
from events.catalogue import Event, NodeJoined, TaskForgotten
from harness.history import history
from projectors import database
from projectors.replay import ReplayError, replay
from projectors.rules import fold
from projectors.store import read_counts, read_offset
from tests.conftest import MakeDb
from tests.projectors.helpers import db_rows, db_rows_of, memory_rows, publish_all

SHOAL = str(Path(sys.executable).parent / "shoal")


def log_events(n_tasks: int) -> list[Event]:
    return [e for e in history(n_tasks=n_tasks) if e.type != "ChunkGenerated"]


async def test_replay_until_seq(js: JetStreamContext, engine: AsyncEngine) -> None:
    events = log_events(40)
    await publish_all(js, events)
    result = await replay(js, engine, until_seq=50, commit_every=20)
    assert (result.applied, result.last_seq) == (50, 50)
    assert await db_rows(engine) == memory_rows(fold(events[:50]))
    async with engine.connect() as conn:
        assert await read_offset(conn, "main", EVENTS_STREAM) == 50
        assert await read_counts(conn, "main", EVENTS_STREAM) == Counter(
            e.type for e in events[:50]
        )


async def test_replay_until_time(js: JetStreamContext, engine: AsyncEngine) -> None:
    events = log_events(20)
    await publish_all(js, events[:30])
    await asyncio.sleep(0.05)
    cut = datetime.now(UTC)
    await asyncio.sleep(0.05)
    await publish_all(js, events[30:])
    result = await replay(js, engine, until_time=cut)
    assert result.last_seq == 30
    assert await db_rows(engine) == memory_rows(fold(events[:30]))


async def test_replay_refuses_a_database_in_use(js: JetStreamContext, engine: AsyncEngine) -> None:
    await publish_all(js, [NodeJoined(node_id="a", origin="a")])
    await replay(js, engine)
    with pytest.raises(ReplayError, match="not empty"):
        await replay(js, engine)


async def test_replay_of_an_empty_log(js: JetStreamContext, engine: AsyncEngine) -> None:
    result = await replay(js, engine)
    assert (result.applied, result.last_seq) == (0, 0)
    assert all(rows == [] for rows in (await db_rows(engine)).values())


async def _offset(url: str) -> int:
    engine = database.create_engine(url)
    try:
        async with engine.connect() as conn:
            return await read_offset(conn, "main", EVENTS_STREAM)
    except Exception:
        return 0  # not migrated yet
    finally:
        await engine.dispose()


async def _counts(url: str) -> dict[str, int]:
    engine = database.create_engine(url)
    try:
        async with engine.connect() as conn:
            return await read_counts(conn, "main", EVENTS_STREAM)
    finally:
        await engine.dispose()


async def _wait_offset(url: str, at_least: int, proc: subprocess.Popen[bytes]) -> int:
    async with asyncio.timeout(60):
        while (seq := await _offset(url)) < at_least:
            assert proc.poll() is None, "projector exited"
            await asyncio.sleep(0.02)
    return seq


def _projector(nats_url: str, db_url: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [SHOAL, "projector", "--nats", nats_url, "--db", db_url],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SHOAL_LOG_LEVEL": "INFO"},
        )


@pytest.mark.slow
async def test_live_projection_survives_sigkill_and_equals_replay(
    nats_server: EmbeddedNats, js: JetStreamContext, make_db: MakeDb, tmp_path: Path
) -> None:
    """Several nodes, instances placed, re-placed and deleted, hundreds of tasks with chunks; the
    projector process is killed with SIGKILL part-way and restarted. A replay into a fresh
    database then gives rows identical to the live projection."""
    all_events = list(history(n_tasks=400, seed=7))
    thirds = [all_events[: len(all_events) // 3], all_events[len(all_events) // 3 :]]
    live_url, replay_url = await make_db(), await make_db()
    log = tmp_path / "projector.log"

    await publish_all(js, thirds[0])
    proc = _projector(nats_server.url, live_url, log)
    rest = thirds[1]
    publishing = asyncio.create_task(publish_all(js, rest[: len(rest) // 2]))
    await _wait_offset(live_url, 1, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    killed_at = await _offset(live_url)
    await publishing
    last = await publish_all(js, rest[len(rest) // 2 :])
    assert 0 < killed_at < last

    proc = _projector(nats_server.url, live_url, log)
    await _wait_offset(live_url, last, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0, log.read_text()

    out = await asyncio.to_thread(
        subprocess.run,
        [SHOAL, "replay", "--nats", nats_server.url, "--db", replay_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"up to seq {last}" in out.stdout

    live, replayed = await db_rows_of(live_url), await db_rows_of(replay_url)
    assert live == replayed
    log_only = [e for e in all_events if e.type != "ChunkGenerated"]
    assert live == memory_rows(fold(log_only))
    # The counts by type were committed with the rows, across the kill, as a replay counts.
    counts = [await _counts(url) for url in (live_url, replay_url)]
    assert counts[0] == counts[1] == Counter(e.type for e in log_only)
    forgotten = {e.task_id for e in log_only if isinstance(e, TaskForgotten)}
    assert forgotten and len(live["tasks"]) == 400 - len(forgotten)
    assert {r["status"] for r in live["tasks"]} == {"completed", "failed", "cancelled"}
