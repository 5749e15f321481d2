"""Snapshots of the projection and a log whose old events aged out (projectors/snapshot.py),
against a real nats-server and real SQLite / PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import Event
from harness.history import history
from projectors import database, snapshot
from projectors.projector import ProjectionLost, Projector
from projectors.replay import ReplayError, replay
from projectors.rules import fold
from projectors.store import read_counts, read_offset
from tests.conftest import MakeDb
from tests.projectors.helpers import db_rows, memory_rows, publish_all, wait_for_seq

EVENTS = [e for e in history(n_tasks=60, seed=5) if e.type != "ChunkGenerated"]


async def _project_to(js: JetStreamContext, engine: AsyncEngine, seq: int) -> None:
    """A projector run until it has applied ``seq``, writing no snapshot of its own."""
    projector = Projector(js, engine, snapshot_every=0)
    stop = asyncio.Event()
    running = asyncio.create_task(projector.run(stop))
    try:
        await wait_for_seq(projector, seq)
    finally:
        stop.set()
        await running


async def _age_out(js: JetStreamContext, before_seq: int) -> None:
    """Events before ``before_seq`` gone, as the stream's age limit removes them."""
    await js.purge_stream(EVENTS_STREAM, seq=before_seq)
    assert (await js.stream_info(EVENTS_STREAM)).state.first_seq == before_seq


async def test_a_snapshot_restores_the_projection_and_its_place(
    js: JetStreamContext, engine: AsyncEngine, make_db: MakeDb
) -> None:
    last = await publish_all(js, EVENTS)
    await _project_to(js, engine, last)
    made = await snapshot.write(engine, js, "main")
    assert made.seq == last and made.size > 0
    assert await snapshot.listed(js, "main") == [made]
    other = database.create_engine(await make_db())
    try:
        assert await snapshot.restore(other, js, made) == last
        assert await db_rows(other) == await db_rows(engine)
        async with other.connect() as conn:
            assert await read_offset(conn, "main", EVENTS_STREAM) == last
            async with engine.connect() as theirs:
                ours = await read_counts(conn, "main", EVENTS_STREAM)
                assert ours == await read_counts(theirs, "main", EVENTS_STREAM)
    finally:
        await other.dispose()


async def test_old_snapshots_go_beyond_the_kept_number(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    await ensure_streams(js)
    seqs = []
    for e in EVENTS[:4]:
        seq = await publish_all(js, [e])
        await _project_to(js, engine, seq)
        seqs.append((await snapshot.write(engine, js, "main", keep=2)).seq)
    assert [s.seq for s in await snapshot.listed(js, "main")] == seqs[-2:]
    assert snapshot.chosen(await snapshot.listed(js, "main"), seqs[-1] - 1) is not None
    assert snapshot.chosen(await snapshot.listed(js, "main"), seqs[0]) is None


async def test_snapshots_add_nothing_to_the_engines_statement_cache(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """A projector writes a snapshot again and again: each used to compile Alembic's version
    query anew into the engine's cache (an entry a snapshot: a long soak's projector grew)."""
    last = await publish_all(js, EVENTS)
    await _project_to(js, engine, last)
    await snapshot.write(engine, js, "main")
    cache = engine.sync_engine._compiled_cache  # SQLAlchemy's LRU of compiled statements
    assert cache is not None
    cached = len(cache)
    for _ in range(3):
        await snapshot.write(engine, js, "main")
    assert len(cache) == cached
    newest = (await database.current_revision(engine)) or ""
    # One snapshot (the same sequence each time), written with the schema's revision.
    assert [s.revision for s in await snapshot.listed(js, "main")] == [newest]


async def test_a_projector_behind_an_aged_log_starts_from_a_snapshot_or_stops(
    js: JetStreamContext, engine: AsyncEngine, make_db: MakeDb
) -> None:
    """A new projector (empty database) after the first events aged out: from the snapshot
    that covers them, to the rows of the whole log; without one it refuses to start."""
    cut = len(EVENTS) // 2
    at_cut = await publish_all(js, EVENTS[:cut])
    await _project_to(js, engine, at_cut)
    last = await publish_all(js, EVENTS[cut:])
    await _age_out(js, at_cut + 1)

    fresh = database.create_engine(await make_db())
    try:
        with pytest.raises(ProjectionLost, match=f"events 1..{at_cut} are gone"):
            await Projector(js, fresh, snapshot_every=0).run(asyncio.Event())
    finally:
        await fresh.dispose()

    await snapshot.write(engine, js, "main")
    fresh = database.create_engine(await make_db())
    try:
        await _project_to(js, fresh, last)
        assert await db_rows(fresh) == memory_rows(fold(EVENTS))
    finally:
        await fresh.dispose()


async def test_replay_starts_from_a_snapshot_and_names_the_oldest_event(
    js: JetStreamContext, engine: AsyncEngine, make_db: MakeDb
) -> None:
    cut = len(EVENTS) // 3
    at_cut = await publish_all(js, EVENTS[:cut])
    await _project_to(js, engine, at_cut)
    await snapshot.write(engine, js, "main")
    last = await publish_all(js, EVENTS[cut:])
    await _age_out(js, at_cut + 1)

    rebuilt = database.create_engine(await make_db())
    try:
        result = await replay(js, rebuilt)
        assert result.last_seq == last and result.applied == last - at_cut
        assert await db_rows(rebuilt) == memory_rows(fold(EVENTS))
    finally:
        await rebuilt.dispose()
    too_old = database.create_engine(await make_db())
    try:
        with pytest.raises(
            ReplayError, match=f"older than the log's oldest kept event, #{at_cut + 1}"
        ):
            await replay(js, too_old, until_seq=at_cut - 2)
        with pytest.raises(ReplayError, match="cannot be rebuilt"):
            await replay(js, too_old, until_seq=at_cut, from_snapshot=False)
    finally:
        await too_old.dispose()


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
)
@given(seed=st.integers(0, 10_000), cut=st.floats(0.05, 0.95))
async def test_retention_with_a_snapshot_equals_the_whole_log(
    tmp_path_factory: pytest.TempPathFactory, make_db: MakeDb, seed: int, cut: float
) -> None:
    """For random histories cut anywhere: project to the cut, snapshot, lose every event up
    to it, replay from the snapshot to the end; the rows are those of the whole log."""
    events: list[Event] = [e for e in history(n_tasks=25, seed=seed) if e.type != "ChunkGenerated"]
    k = max(1, int(len(events) * cut))
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        live = database.create_engine(await make_db())
        rebuilt = database.create_engine(await make_db())
        try:
            at_cut = await publish_all(js, events[:k])
            await _project_to(js, live, at_cut)
            await snapshot.write(live, js, "main")
            await publish_all(js, events[k:])
            await _age_out(js, at_cut + 1)
            await replay(js, rebuilt)
            assert await db_rows(rebuilt) == memory_rows(fold(events))
        finally:
            await live.dispose()
            await rebuilt.dispose()
            await nc.close()


def test_a_writer_killed_half_way_leaves_the_snapshot_before(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """A process that writes a snapshot killed (SIGKILL) after its first chunks: its snapshot is
    not listed, the one before it is still the newest, and it restores."""

    async def setup() -> tuple[str, int]:
        nc = await connect(nats_server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        db = f"sqlite:///{tmp_path / 'live.db'}"
        engine = database.create_engine(db)
        seq = await publish_all(js, EVENTS[:20])
        await _project_to(js, engine, seq)
        await snapshot.write(engine, js, "main")
        # More rows (and a bigger snapshot) for the one that is killed.
        await _project_to(js, engine, await publish_all(js, EVENTS[20:]))
        await engine.dispose()
        await nc.close()
        return db, seq

    db, first = asyncio.run(setup())
    killed = subprocess.run(
        [sys.executable, "-m", "tests.faults.killed_snapshot", nats_server.url, db],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    async def check() -> None:
        nc = await connect(nats_server.url)
        js = nc.jetstream()
        listed = await snapshot.listed(js, "main")
        assert [s.seq for s in listed] == [first]
        engine = database.create_engine(f"sqlite:///{tmp_path / 'restored.db'}")
        assert await snapshot.restore(engine, js, listed[0]) == first
        assert await db_rows(engine) == memory_rows(fold(EVENTS[:20]))
        await engine.dispose()
        await nc.close()

    asyncio.run(check())


async def test_the_projector_writes_snapshots_as_it_goes(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    projector = Projector(js, engine, snapshot_every=50)
    stop = asyncio.Event()
    running = asyncio.create_task(projector.run(stop))
    try:
        for i in range(0, len(EVENTS), 40):  # batches of 40: one snapshot per 50 at least
            await wait_for_seq(projector, await publish_all(js, EVENTS[i : i + 40]))
    finally:
        stop.set()
        await running
    seqs = [s.seq for s in await snapshot.listed(js, "main")]
    assert seqs and len(seqs) <= snapshot.KEEP and projector.snapshot_seq == seqs[-1]
    assert all(b - a >= 50 for a, b in itertools.pairwise(seqs))
