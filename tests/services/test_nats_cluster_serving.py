"""Serving through a 3-server NATS cluster (JetStream replicas 3) while one server is lost.

Each server is on a test host of its own. A worker (SmolLM2 on llama.cpp) is on n0's host;
projector, planner and three `shoal api` processes are on this machine, across the bridge: the
projector and planner use n0 first, each API a different server first, all given every
server's URL. 60 streamed
chat requests are spread over the APIs, and partway the server n1 is killed, after being made
the leader of both streams and of the task and projector consumers (the hardest place to lose).

No event is lost (every task an API accepted has its outcome in the log, the log has no gap or
duplicate, and the live projection equals a replay), and every request either completes or gets
a clear error (an OpenAI error object, in the body or as an SSE event); failures can only be
requests through the API that was on the lost server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client

from bus.connection import connect
from bus.embedded import free_port
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM, StreamSettings, ensure_streams
from events.catalogue import NodeJoined, NodeTimedOut, RunnerStateChanged, TaskCreated, TaskStarted
from harness.clusters import NatsCluster
from harness.hosts import Network
from harness.processes import SHOAL, Processes, wait_healthy
from projectors import database
from projectors.store import read_offset
from services.runner import tasks_consumer_name
from tests.bus.nats_cluster import make_consumer_leader, make_leader, stream_info
from tests.faults.invariants import (
    Outcome,
    all_rows,
    chat,
    check_answered,
    check_stored_once,
    check_tasks_ended,
    read_log_once_ended,
    replayed_rows,
)
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

REQUESTS = 60
CONCURRENCY = 8
LOSE_AFTER = 20  # requests finished before the server is lost
VICTIM = 1
LOG_WAIT_S = 3  # how long the last API waits for the log to store a task (--log-wait)


async def _move_leaders(nc: Client, to: str) -> None:
    """Make server ``to`` the leader of both streams and of the durable consumers."""
    for stream in (EVENTS_STREAM, CHUNKS_STREAM):
        await make_leader(nc, stream, to)
    for consumer in ("projector-main", tasks_consumer_name("smollm2-135m")):
        await make_consumer_leader(nc, EVENTS_STREAM, consumer, to)


async def _offset(db_url: str) -> int:
    engine = database.create_engine(db_url)
    try:
        async with engine.connect() as conn:
            return await read_offset(conn, "main", EVENTS_STREAM)
    finally:
        await engine.dispose()


async def test_losing_a_nats_server_while_serving(tmp_path: Path, hosts: Network) -> None:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {**os.environ, "SHOAL_DATA_DIR": str(tmp_path / "cli"), "SHOAL_STREAM_REPLICAS": "3"}
    async with NatsCluster(tmp_path / "nats", hosts) as cluster:
        back = cluster.urls_from(0)  # projector, planner, worker and its runner: on n0
        nc = await connect(back, name="test")
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings(replicas=3))
        log = await EventLog().start(js)
        with Processes(tmp_path / "logs", env) as procs:
            procs.start("projector", "projector", "--nats", back, "--db", db)
            procs.start("planner", "planner", "--nats", back, "--db", db)
            procs.start(
                "w-a",
                "worker",
                "--nats",
                back,
                "--node-id",
                "w-a",
                "--data-dir",
                str(tmp_path / "w-a"),
                "--runner-threads",
                "1",
                host=hosts.hosts[0],
            )
            apis = []
            for i in range(3):
                port = free_port()
                procs.start(
                    f"api{i}",
                    "api",
                    "--nats",
                    cluster.urls_from(i),
                    "--db",
                    db,
                    "--port",
                    str(port),
                )
                apis.append(f"http://127.0.0.1:{port}")
            await log.wait_for(NodeJoined, timeout=60)
            await procs.wait_log("projector", "resuming after seq")
            created = await asyncio.to_thread(
                subprocess.run,
                [
                    SHOAL,
                    "instances",
                    "create",
                    "smollm2-135m",
                    "--id",
                    "inst",
                    "--nats",
                    back,
                    "--db",
                    db,
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            assert created.returncode == 0, created.stderr
            await log.wait_for(RunnerStateChanged, lambda e: e.state == "Ready", timeout=90)
            for i, url in enumerate(apis):
                await wait_healthy(url)
                # Each API is on the server its URL list names first.
                assert f"connected to {cluster.servers[i].url}" in procs.log(f"api{i}")
            await _move_leaders(nc, f"n{VICTIM}")

            urls = {f"api{i}": url for i, url in enumerate(apis)}
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(REQUESTS):
                queue.put_nowait(i)
            outcomes: list[Outcome] = []
            lost = asyncio.Event()

            async def work(client: httpx.AsyncClient) -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    api = f"api{i % 3}"
                    outcomes.append(
                        await chat(
                            client, api, urls[api], label=f"r{i}", stream=True, content="Say hi."
                        )
                    )
                    if len(outcomes) == LOSE_AFTER:
                        lost.set()

            started = time.monotonic()
            limits = httpx.Limits(max_connections=CONCURRENCY * 2)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                workers = [asyncio.create_task(work(client)) for _ in range(CONCURRENCY)]
                await lost.wait()
                lost_at = time.monotonic() - started
                cluster.servers[VICTIM].kill()
                await asyncio.gather(*workers)
            took = time.monotonic() - started
            print(f"{REQUESTS} requests in {took:.1f} s; n{VICTIM} killed at {lost_at:.1f} s")

            # No event lost or stored twice, every task ended once; every request completed
            # (its text is its chunks in the log) or got a clear error, and only through the
            # API that was on the lost server.
            await stream_info(nc, EVENTS_STREAM)  # the streams have a leader again
            stored = await read_log_once_ended(js)
            check_stored_once(stored)
            check_tasks_ended(stored)
            check_answered(outcomes, errors_allowed=True, log=stored)
            failed = [o for o in outcomes if o.kind != "completed"]
            assert {o.api for o in failed} <= {f"api{VICTIM}"}, [str(o) for o in failed]
            assert "reconnected to" in procs.log(f"api{VICTIM}")
            created_ids = Counter(e.task_id for e in stored.of(TaskCreated))
            assert set(created_ids.values()) == {1}
            assert set(Counter(e.task_id for e in stored.of(TaskStarted)).values()) <= {1}
            assert {o.task_id for o in outcomes if o.task_id} <= set(created_ids)
            assert not stored.of(NodeTimedOut)
            n_chunks = (await stream_info(nc, CHUNKS_STREAM)).state.messages
            print(f"{len(stored.events)} events, {n_chunks} chunks, {len(created_ids)} tasks")

            # The live projection equals a replay of the log.
            last = stored.events[-1][0]
            async with asyncio.timeout(60):
                while await _offset(db) < last:
                    await asyncio.sleep(0.1)
            procs.procs["projector"].send_signal(signal.SIGTERM)
            procs.procs["projector"].wait(20)
            at = await _offset(db)  # heartbeats go on: replay to where the projector stopped
            engine = database.create_engine(db)
            try:
                live = await all_rows(engine)
            finally:
                await engine.dispose()
            again = await replayed_rows(js, tmp_path / "replay.db", at)
            for table in live:
                assert live[table] == again[table], f"table {table}: the projection != a replay"
            statuses = {r["status"] for r in live["tasks"]}
            assert {r["task_id"] for r in live["tasks"]} == set(created_ids)
            assert statuses <= {"completed", "failed", "cancelled"}

            # With a second server lost the cluster has no quorum: nothing can be stored, and a
            # request gets a clear error once the API gave up publishing it (--log-wait; the
            # other APIs wait 30 s, which rode out the election above on a loaded machine).
            port = free_port()
            procs.start(
                "api-nq",
                "api",
                "--nats",
                back,
                "--db",
                db,
                "--port",
                str(port),
                "--log-wait",
                str(LOG_WAIT_S),
            )
            await wait_healthy(f"http://127.0.0.1:{port}")
            cluster.servers[2].stop()
            asked_at = time.monotonic()
            async with httpx.AsyncClient(timeout=60) as client:
                both = await asyncio.gather(
                    *(
                        chat(
                            client,
                            "api-nq",
                            f"http://127.0.0.1:{port}",
                            label=f"no-quorum-{streamed}",
                            stream=streamed,
                            content="Say hi.",
                        )
                        for streamed in (True, False)
                    )
                )
            for o in both:
                assert o.kind == "error" and o.error is not None, o
                assert o.error["code"] == "log_unavailable", o
            assert [o.status for o in both] == [503, 503]  # a stream too: before it starts
            assert time.monotonic() - asked_at < 20  # --log-wait, not the default 30 s
            await asyncio.to_thread(cluster.servers[2].start)  # so that the services stop cleanly
        await log.stop()
        await nc.close()
