"""A log that went back behind the projection (a power cut lost the nats-server's unsynced
tail, simulated by putting back a copy of its store): the projector notices at its start,
reports it, and rebuilds the projection from what the log holds, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import Event, LogTailLost, NodeJoined, TaskCreated
from events.records import ChatMessage
from projectors import database, snapshot
from projectors.replay import replay
from projectors.store import read_counts, read_tracking
from projectors.tables import projector_offsets
from tests.conftest import MakeDb
from tests.faults.invariants import read_log
from tests.projectors.helpers import db_rows, publish_all, running_projector, wait_for_seq


def _tasks(prefix: str, n: int) -> list[Event]:
    return [
        TaskCreated(
            task_id=f"{prefix}-{i}",
            model_id="m",
            origin="t",
            messages=[ChatMessage(role="user", content=prefix)],
        )
        for i in range(n)
    ]


async def _project(js: JetStreamContext, url: str, seq: int, *, snap: bool = False) -> None:
    engine = database.create_engine(url)
    try:
        async with running_projector(js, engine, snapshot_every=0) as projector:
            await wait_for_seq(projector, seq)
        if snap:
            await snapshot.write(engine, js, "main")
    finally:
        await engine.dispose()


@pytest.mark.parametrize("after", [2, 9], ids=["log-shorter", "numbers-reused"])
async def test_a_lost_tail_is_noticed_reported_and_rebuilt(
    tmp_path: Path, make_db: MakeDb, after: int
) -> None:
    """``after``: events published after the power cut, fewer than were lost (the log ends
    before the tracking row) or more (newer events hold the numbers the projection applied)."""
    url = await make_db()
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    try:
        nc = await connect(server.url, name="test")
        js = nc.jetstream()
        await ensure_streams(js)
        kept = [NodeJoined(node_id="n1", origin="t"), *_tasks("kept", 4)]
        synced = await publish_all(js, kept)
        await _project(js, url, synced, snap=True)  # a snapshot the log will still hold
        await nc.close()
        server.stop()  # clean: everything on disk, which the copy keeps
        copy = tmp_path / "store-copy"
        shutil.copytree(server.data_dir / "jetstream", copy)

        server.start()
        nc = await connect(server.url, name="test")
        js = nc.jetstream()
        lost = await publish_all(js, _tasks("lost", 6))
        await _project(js, url, lost, snap=True)  # a snapshot of a history about to go
        await nc.close()
        server.kill()  # the power cut: the unsynced tail is what the copy lacks
        shutil.rmtree(server.data_dir / "jetstream")
        shutil.copytree(copy, server.data_dir / "jetstream")

        server.start()
        nc = await connect(server.url, name="test")
        js = nc.jetstream()
        assert (await js.stream_info(EVENTS_STREAM)).state.last_seq == synced
        last = await publish_all(js, _tasks("after", after))
        await _project(js, url, last + 1)  # + its LogTailLost

        log = await read_log(js)
        (report,) = log.of(LogTailLost)
        assert (report.tracking_seq, report.stream_last_seq) == (lost, last)
        assert report.rebuilt_from_seq == synced and report.reader == "projector:main"
        assert report.dropped
        # The lost history's snapshot is gone; the one the log still holds stays.
        assert [s.seq for s in await snapshot.listed(js, "main")] == [synced]

        # The projection is the log's: the lost tasks gone, every later one there, equal
        # to a replay, tracking row and counts included.
        engine = database.create_engine(url)
        fresh = database.create_engine(await make_db())
        try:
            rows = await db_rows(engine)
            tasks = {r["task_id"] for r in rows["tasks"]}
            assert tasks == {f"kept-{i}" for i in range(4)} | {f"after-{i}" for i in range(after)}
            await replay(js, fresh, from_snapshot=False)
            assert await db_rows(fresh) == rows
            async with engine.connect() as a, fresh.connect() as b:
                tracking = await read_tracking(a, "main", EVENTS_STREAM)
                assert tracking == await read_tracking(b, "main", EVENTS_STREAM)
                assert tracking[0] == last + 1 and tracking[1]
                counts = await read_counts(a, "main", EVENTS_STREAM)
                assert counts == await read_counts(b, "main", EVENTS_STREAM)
                assert counts[LogTailLost.__name__] == 1
                assert len((await a.execute(projector_offsets.select())).all()) == 1
        finally:
            await engine.dispose()
            await fresh.dispose()

        # Started again, it finds its log whole: nothing more is reported.
        await _project(js, url, last + 1)
        assert len((await read_log(js)).of(LogTailLost)) == 1
        await nc.close()
    finally:
        server.stop()


async def _publish(url: str, events: list[Event]) -> int:
    """Published from a connection of their own (the projector's reconnects meanwhile)."""
    nc = await connect(url, name="publisher")
    try:
        return await publish_all(nc.jetstream(), events)
    finally:
        await nc.close()


async def test_a_running_projector_notices_when_its_server_comes_back_shorter(
    tmp_path: Path, make_db: MakeDb
) -> None:
    """The projector runs through it: its nats-server loses power and comes back with an older
    store, and newer events take the lost numbers before the projector pulls again. It notices
    on reconnecting (its consumer went with the server), before it applies any of them."""
    url = await make_db()
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    engine = database.create_engine(url)
    nc = await connect(server.url, name="test")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        async with running_projector(js, engine, snapshot_every=0) as projector:
            synced = await publish_all(js, _tasks("kept", 3))
            await wait_for_seq(projector, synced)
            server.stop()
            shutil.copytree(server.data_dir / "jetstream", tmp_path / "store-copy")
            server.start()
            lost = await _publish(server.url, _tasks("lost", 4))
            await wait_for_seq(projector, lost)
            server.kill()
            shutil.rmtree(server.data_dir / "jetstream")
            shutil.copytree(tmp_path / "store-copy", server.data_dir / "jetstream")
            server.start()
            last = await _publish(server.url, _tasks("after", 6))  # past the lost numbers
            async with asyncio.timeout(60):
                while projector.applied_seq <= last:  # its LogTailLost too
                    await asyncio.sleep(0.05)
        async with asyncio.timeout(30):
            while not nc.is_connected:
                await asyncio.sleep(0.05)
        (report,) = (await read_log(js)).of(LogTailLost)
        assert (report.tracking_seq, report.stream_last_seq) == (lost, last)
        assert "not the one read there" in report.dropped
        rows = await db_rows(engine)
        assert {r["task_id"] for r in rows["tasks"]} == {f"kept-{i}" for i in range(3)} | {
            f"after-{i}" for i in range(6)
        }
    finally:
        await nc.close()
        await engine.dispose()
        server.stop()
