"""A power cut. A nats-server that acknowledges writes before they are on disk loses them with
the machine's power; simulated as the issue did: `shoal up` stopped cleanly and its NATS store
copied, requests served, every process of the node SIGKILLed at once, the copy put back (the
log lost its tail, the projection kept what it committed), `shoal up` started again and more
requests served. Afterwards every request made after the restart is in the projection, the
projection equals a replay of the log, and the loss was reported (``LogTailLost``, the log line
and ``/metrics``); on SQLite and on PostgreSQL.

And the embedded server's own setting (``sync_interval: always``) in force: nats-server
SIGKILLed under a load of publishes keeps every one it acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from pathlib import Path

import httpx
import nats.errors
import psutil
import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import LogTailLost, NodeJoined, TaskCompleted, TaskCreated
from harness.processes import SHOAL
from harness.shoal_up import Drained, read_until_ready, start
from projectors import database
from projectors.projector import Projector
from projectors.store import load_state
from tests.conftest import MakeDb
from tests.faults.invariants import Outcome, all_rows, chat, read_log, replayed_rows


async def _serve(url: str, label: str, n: int) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=120) as client:
        done = [
            await chat(client, "up", url, label=f"{label}-{i}", stream=i % 2 == 1) for i in range(n)
        ]
    assert all(o.kind == "completed" and o.task_id for o in done), [str(o) for o in done]
    return done


async def _projected(db_url: str, task_ids: set[str], timeout: float = 30) -> None:
    """Until the projection has every one of these tasks completed."""
    engine = database.create_engine(db_url)
    try:
        async with asyncio.timeout(timeout):
            while True:
                async with engine.connect() as conn:
                    state = await load_state(conn, ["tasks"])
                rows = [state.task(t) for t in task_ids]
                if all(r is not None and r.status == "completed" for r in rows):
                    return
                await asyncio.sleep(0.1)
    finally:
        await engine.dispose()


def _power_cut(up: Drained) -> None:
    """Every process of the node, SIGKILLed at once (the nats-server runs in a session of its
    own, the runners under the worker)."""
    procs = [psutil.Process(up.proc.pid), *psutil.Process(up.proc.pid).children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    up.proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_power_cut_is_noticed_and_the_projection_is_the_logs(
    tmp_path: Path, make_db: MakeDb
) -> None:
    db_url = await make_db()
    data = tmp_path / "data"
    port, nats_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [SHOAL, "up", "--data-dir", str(data), "--port", str(port), "--nats-port"]
    argv += [str(nats_port), "--db", db_url, "--runner-threads", "1"]
    store = data / "nats" / "jetstream"

    said: list[str] = []  # what `shoal up` wrote (its log lines too), every run

    async def up() -> Drained:
        proc = start(argv)
        said.extend(await read_until_ready(proc))
        return Drained(proc)

    node = await up()
    try:
        before = await _serve(url, "before", 1)
        node.stop()  # clean: all on disk, which the copy keeps
        shutil.copytree(store, tmp_path / "store-copy")

        node = await up()
        lost = await _serve(url, "lost", 3)
        await _projected(db_url, {o.task_id for o in lost if o.task_id})
        _power_cut(node)
        shutil.rmtree(store)
        shutil.copytree(tmp_path / "store-copy", store)

        node = await up()
        after = await _serve(url, "after", 3)
        await _projected(db_url, {o.task_id for o in after if o.task_id})
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{url}/metrics")).text
        assert "shoal_log_tail_lost_total 1.0" in metrics
        said.append(node.stop())
        assert "CRITICAL projectors.projector: THE EVENT LOG LOST ITS TAIL" in "".join(said)
    finally:
        if node.proc.poll() is None:
            node.stop()

    # The log, quiet now, folded to its end by a projector of its own; then compared.
    with EmbeddedNats(data / "nats", port=nats_port) as server:
        nc = await connect(server.url, name="test")
        js = nc.jetstream()
        await ensure_streams(js)
        last = (await js.stream_info(EVENTS_STREAM)).state.last_seq
        engine = database.create_engine(db_url)
        try:
            projector = Projector(js, engine, snapshot_every=0)
            stop = asyncio.Event()
            running = asyncio.create_task(projector.run(stop))
            async with asyncio.timeout(60):
                while projector.applied_seq < last:
                    await asyncio.sleep(0.05)
            stop.set()
            await running
            live = await all_rows(engine)
            replayed = await replayed_rows(js, tmp_path / "replay.db", last)
            log = await read_log(js)
        finally:
            await engine.dispose()
            await nc.close()
    for table, rows in live.items():
        assert rows == replayed[table], f"table {table}: the projection != a replay"
    tasks = {r["task_id"] for r in live["tasks"]}
    assert {o.task_id for o in before + after} <= tasks
    assert not {o.task_id for o in lost} & tasks, "tasks the log lost stay in the projection"
    (report,) = log.of(LogTailLost)
    print("reported:", report.model_dump_json())
    assert report.reader == "projector:main" and report.dropped and report.tracking_seq > 0
    assert not {e.task_id for e in log.of(TaskCreated)} & {o.task_id for o in lost}
    completed = {e.task_id for e in log.of(TaskCompleted)}
    assert {o.task_id for o in after} <= completed


async def test_every_acknowledged_publish_outlives_a_sigkilled_nats_server(
    tmp_path: Path,
) -> None:
    """Publishers under load (``Publisher``, as every service publishes) while the embedded
    server, with its default ``sync_interval: always``, is SIGKILLed: each event whose publish
    was acknowledged is in the log once the server is back, once."""
    server = EmbeddedNats(tmp_path / "nats")
    assert server.sync == "always"
    server.start()
    acked: list[str] = []
    try:
        nc = await connect(server.url, name="test")
        js = nc.jetstream()
        await ensure_streams(js)
        publisher = Publisher(js, timeout=2.0, retry_for=0)

        async def publish_until_refused(worker: int) -> None:
            for i in range(100_000):
                event = NodeJoined(node_id=f"w{worker}-{i}", origin="test")
                try:
                    await publisher.publish(event)
                except (nats.errors.Error, TimeoutError, OSError):
                    return
                acked.append(event.event_id)

        publishers = [asyncio.create_task(publish_until_refused(w)) for w in range(8)]
        async with asyncio.timeout(60):
            while len(acked) < 300:
                await asyncio.sleep(0.01)
        server.kill()  # mid-load
        await asyncio.gather(*publishers)
        with contextlib.suppress(OSError):  # its server is gone: the flush on close may fail
            await nc.close()
        server.start()
        nc = await connect(server.url, name="test")
        log = await read_log(nc.jetstream())
        await nc.close()
    finally:
        server.stop()
    stored = [e.event_id for _, e in log.events]
    assert len(stored) == len(set(stored))
    missing = set(acked) - set(stored)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged events are gone"
    print(f"{len(acked)} acknowledged, {len(stored)} stored")
