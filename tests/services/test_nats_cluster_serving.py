"""Serving through a 3-server NATS cluster (JetStream replicas 3) while one server is lost.

Projector, planner and a worker (SmolLM2 on llama.cpp) are on server n0; three `shoal api`
processes are each on a different server first, all given every server's URL. 200 streamed
chat requests are spread over the APIs, and partway the server n1 is killed, after being made
the leader of both streams and of the task and projector consumers (the hardest place to lose).

No event is lost (every task an API accepted has its outcome in the log, the log has no gap or
duplicate, and the live projection equals a replay), and every request either completes or gets
a clear error (an OpenAI error object, in the body or as an SSE event); failures can only be
requests through the API that was on the lost server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client

from bus.connection import connect
from bus.embedded import free_port
from bus.events import (
    NodeJoined,
    NodeTimedOut,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
    parse_event,
)
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM, StreamSettings, ensure_streams
from projectors import database
from projectors.store import read_offset
from services.runner.serve import tasks_consumer_name
from tests.api.conftest import wait_healthy
from tests.bus.nats_cluster import (
    NatsCluster,
    make_consumer_leader,
    make_leader,
    stream_info,
)
from tests.projectors.helpers import db_rows_of
from tests.services.event_log import EventLog
from tests.services.processes import SHOAL, Processes

pytestmark = pytest.mark.slow

REQUESTS = 200
CONCURRENCY = 8
LOSE_AFTER = 60  # requests finished before the server is lost
VICTIM = 1
BODY = {
    "model": "smollm2-135m",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 8,
    "temperature": 0.0,
    "stream": True,
}


@dataclass
class Outcome:
    api: int
    task_id: str | None = None  # known once the API accepted the task (its first SSE event)
    text: str = ""
    finish: str | None = None
    done: bool = False  # "data: [DONE]" came
    error: dict[str, object] | None = None  # an OpenAI error object
    status: int = 0
    broken: str | None = None  # anything else: a transport error, a hang, a garbled stream
    lines: list[str] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.finish is not None and not self.broken


async def _chat(client: httpx.AsyncClient, url: str, out: Outcome) -> None:
    try:
        async with (
            asyncio.timeout(60),
            client.stream("POST", f"{url}/v1/chat/completions", json=BODY) as r,
        ):
            out.status = r.status_code
            if r.status_code != 200:
                out.error = json.loads(await r.aread())["error"]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                out.lines.append(line)
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    out.done = True
                    continue
                payload = json.loads(data)
                if "error" in payload:
                    out.error = payload["error"]
                    continue
                out.task_id = payload["id"].removeprefix("chatcmpl-")
                for choice in payload["choices"]:
                    out.text += choice["delta"].get("content", "")
                    out.finish = choice["finish_reason"] or out.finish
    except (httpx.HTTPError, TimeoutError, ValueError, KeyError) as exc:
        out.broken = repr(exc)


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


async def test_losing_a_nats_server_while_serving(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {**os.environ, "SHOAL_DATA_DIR": str(tmp_path / "cli"), "SHOAL_STREAM_REPLICAS": "3"}
    async with NatsCluster(tmp_path / "nats") as cluster:
        back = cluster.urls_from(0)  # projector, planner, worker and its runner: on n0
        nc = await connect(back, name="test")
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings(replicas=3))
        log = await EventLog().start(js)
        with Processes(tmp_path / "logs", env) as procs:
            procs.start("projector", "projector", "--nats", back, "--db", db)
            procs.start("planner", "planner", "--nats", back, "--db", db)
            procs.start("w-a", "worker", "--nats", back, "--node-id", "w-a", "--data-dir",
                        str(tmp_path / "w-a"), "--runner-threads", "1")  # fmt: skip
            apis = []
            for i in range(3):
                port = free_port()
                procs.start(f"api{i}", "api", "--nats", cluster.urls_from(i), "--db", db,
                            "--port", str(port))  # fmt: skip
                apis.append(f"http://127.0.0.1:{port}")
            await log.wait_for(NodeJoined, timeout=60)
            await procs.wait_log("projector", "resuming after seq")
            created = await asyncio.to_thread(
                subprocess.run,
                [SHOAL, "instances", "create", "smollm2-135m", "--id", "inst", "--nats", back,
                 "--db", db],
                capture_output=True, text=True, env=env, timeout=120,
            )  # fmt: skip
            assert created.returncode == 0, created.stderr
            await log.wait_for(RunnerStateChanged, lambda e: e.state == "Ready", timeout=90)
            for i, url in enumerate(apis):
                await wait_healthy(url)
                # Each API is on the server its URL list names first.
                assert f"connected to {cluster.servers[i].url}" in procs.log(f"api{i}")
            await _move_leaders(nc, f"n{VICTIM}")

            outcomes = [Outcome(api=i % 3) for i in range(REQUESTS)]
            queue: asyncio.Queue[Outcome] = asyncio.Queue()
            for o in outcomes:
                queue.put_nowait(o)
            finished = 0
            lost = asyncio.Event()

            async def work(client: httpx.AsyncClient) -> None:
                nonlocal finished
                while not queue.empty():
                    o = queue.get_nowait()
                    await _chat(client, apis[o.api], o)
                    finished += 1
                    if finished == LOSE_AFTER:
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

            # Every request completed, or got a clear error; only through the lost server's API.
            broken = [o for o in outcomes if o.broken]
            assert not broken, [(o.api, o.broken, o.lines[-3:]) for o in broken]
            failed = [o for o in outcomes if not o.completed]
            for o in failed:
                assert o.error is not None and o.error.get("message"), o
            print("failed:", [(o.api, o.status, o.error) for o in failed])
            assert {o.api for o in failed} <= {VICTIM}
            moved = procs.log(f"api{VICTIM}")
            assert "reconnected to" in moved

            # No event lost: every task an API accepted has its outcome in the log.
            await stream_info(nc, EVENTS_STREAM)  # the streams have a leader again
            events = [m async for m in read_stream(js, EVENTS_STREAM, "shoal.events.>")]
            seqs = [m.metadata.sequence.stream for m in events]
            assert seqs == list(range(1, len(seqs) + 1))
            parsed = [parse_event(m.data) for m in events]
            assert len({e.event_id for e in parsed}) == len(parsed)
            created_ids = Counter(e.task_id for e in parsed if isinstance(e, TaskCreated))
            started_ids = Counter(e.task_id for e in parsed if isinstance(e, TaskStarted))
            ended = Counter(e.task_id for e in parsed if isinstance(e, TaskCompleted | TaskFailed))
            cancelled = {e.task_id for e in parsed if isinstance(e, TaskCancelled)}
            accepted = {o.task_id for o in outcomes if o.task_id}
            assert accepted <= set(created_ids)
            assert set(created_ids.values()) == {1}
            assert set(started_ids.values()) <= {1}
            assert set(ended.values()) <= {1}
            assert set(created_ids) <= set(ended) | cancelled
            for o in outcomes:
                if o.completed:
                    assert o.task_id is not None and ended[o.task_id] == 1
            assert not [e for e in parsed if isinstance(e, NodeTimedOut)]
            n_chunks = (await stream_info(nc, CHUNKS_STREAM)).state.messages
            print(f"{len(parsed)} events, {n_chunks} chunks, {len(created_ids)} tasks")

            # The live projection equals a replay of the log.
            last = seqs[-1]
            async with asyncio.timeout(60):
                while await _offset(db) < last:
                    await asyncio.sleep(0.1)
            procs.procs["projector"].send_signal(signal.SIGTERM)
            procs.procs["projector"].wait(20)
            at = await _offset(db)  # heartbeats go on: replay to where the projector stopped
            replayed = f"sqlite:///{tmp_path / 'replay.db'}"
            out = await asyncio.to_thread(
                subprocess.run,
                [SHOAL, "replay", "--nats", back, "--db", replayed, "--until-seq", str(at)],
                capture_output=True, text=True, env=env, timeout=120,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            assert f"up to seq {at}" in out.stdout
            live, again = await db_rows_of(db), await db_rows_of(replayed)
            differ = {
                t: [(x, y) for x, y in zip(live[t], again[t], strict=False) if x != y]
                for t in live
                if live[t] != again[t]
            }
            assert live == again, differ
            tasks = {r["task_id"]: r for r in live["tasks"]}
            assert set(tasks) == set(created_ids)
            assert {r["status"] for r in tasks.values()} <= {"completed", "failed", "cancelled"}

            # With a second server lost the cluster has no quorum: nothing can be stored, and a
            # request gets a clear error once the API gave up publishing it (30 s).
            cluster.servers[2].stop()
            async with httpx.AsyncClient(timeout=60) as client:
                streamed = Outcome(api=0)
                _, whole = await asyncio.gather(
                    _chat(client, apis[0], streamed),
                    client.post(f"{apis[0]}/v1/chat/completions", json=BODY | {"stream": False}),
                )
            assert streamed.error is not None and streamed.error["code"] == "log_unavailable"
            assert streamed.done and not streamed.broken
            assert whole.status_code == 503
            assert whole.json()["error"]["code"] == "log_unavailable"
            await asyncio.to_thread(cluster.servers[2].start)  # so that the services stop cleanly
        await log.stop()
        await nc.close()
