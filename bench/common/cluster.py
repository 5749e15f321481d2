"""The cluster ``bench.soak`` runs: nats-server, projector, planner, worker (and its runner) and
API as separate processes on loopback, each's output in a log file; the log's stream sizes and
the projection's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from nats.js.errors import NotFoundError

from bench.common.processes import MODEL_ID, SHOAL_BIN
from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port
from bus.stores.object_store import object_stream
from bus.stores.parts import PARTS_STREAM
from bus.streams import CHUNKS_STREAM, DEADLETTER_STREAM, EVENTS_STREAM, SNAPSHOTS_BUCKET
from events.units import MiB
from harness.processes import Proc, wait_until

READY_TIMEOUT = 300.0  # seconds for the cluster to serve the model


@dataclass
class Cluster:
    nats: EmbeddedNats
    parts: dict[str, Proc] = field(default_factory=dict)
    api_url: str = ""
    db: Path = Path()  # the projection's SQLite file

    def pids(self) -> dict[str, list[int]]:
        """The processes of each part; the runner is the worker's child."""
        out: dict[str, list[int]] = {name: [p.proc.pid] for name, p in self.parts.items()}
        out["runner"] = runner_pids(self.parts["worker"].proc.pid)
        nats_proc = self.nats._proc  # the server's process; EmbeddedNats has no accessor
        out["nats-server"] = [nats_proc.pid] if nats_proc is not None else []
        return out

    def stop(self) -> list[str]:
        said = [
            stop_part(self.parts[n])
            for n in ("api", "worker", "planner", "projector")
            if n in self.parts
        ]
        self.nats.stop()
        return said


def stop_part(part: Proc, timeout: float = 30.0) -> str:
    """SIGINT (as Ctrl-C), then SIGKILL to its session if it has not stopped in time."""
    if not part.stop(signal.SIGINT, timeout):
        return f"{part.name}: killed after {timeout:.0f} s"
    return f"{part.name}: exit {part.returncode}"


async def log_bytes(nats_url: str) -> str:
    """What the log's streams, and the projection's snapshots, hold now: with an age limit
    (SHOAL_EVENTS_MAX_AGE), flat once the oldest events go."""
    nc = await connect(nats_url, name="soak-sizes")
    try:
        js = nc.jetstream()
        streams = (EVENTS_STREAM, CHUNKS_STREAM, DEADLETTER_STREAM, PARTS_STREAM)
        sizes = [(s, (await js.stream_info(s)).state.bytes) for s in streams]
        with contextlib.suppress(NotFoundError):  # none written yet
            snapshots = await js.stream_info(object_stream(SNAPSHOTS_BUCKET))
            sizes.append((SNAPSHOTS_BUCKET, snapshots.state.bytes))
    finally:
        await nc.close()
    return ", ".join(f"{name} {n / MiB:8.1f}" for name, n in sizes)


def projection_size(db: Path) -> str:
    """The projection database's bytes on disk (its WAL included) and its task rows: with an
    age limit, flat once the planner forgets the oldest ended tasks."""
    size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (rows,) = conn.execute("SELECT count(*) FROM tasks").fetchone()
    return f"{size / MiB:.1f} MiB, {rows} task rows"


def runner_pids(worker_pid: int) -> list[int]:
    try:
        children = psutil.Process(worker_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if "runner" in child.cmdline():
                out.append(child.pid)
    return out


async def start_cluster(tmp: Path, runner_threads: int, max_queued: int | None) -> Cluster:
    nats = EmbeddedNats(tmp / "nats")
    nats.start()
    cluster = Cluster(nats)
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_API_KEYS"}  # no keys
    env["SHOAL_DATA_DIR"] = str(tmp / "cli")
    logs = tmp / "logs"
    logs.mkdir()
    cluster.db = tmp / "shoal.db"
    db = f"sqlite:///{cluster.db}"
    port = free_port("127.0.0.1")
    cluster.api_url = f"http://127.0.0.1:{port}"
    common = ["--nats", nats.url]
    for name, args in (
        ("projector", ["projector", *common, "--db", db]),
        ("planner", ["planner", *common, "--db", db]),
        (
            "worker",
            [
                "worker",
                *common,
                "--node-id",
                "soak",
                "--data-dir",
                str(tmp / "worker"),
                "--runner-threads",
                str(runner_threads),
                # One runner, the instance's: an idle spare would be counted as a runner that
                # appeared during the run (on-demand loads are bench.cold_start's).
                "--no-warm-runner",
            ],
        ),
        (
            "api",
            [
                "api",
                *common,
                "--db",
                db,
                "--port",
                str(port),
                *(["--max-queued", str(max_queued)] if max_queued is not None else []),
            ],
        ),
    ):
        cluster.parts[name] = Proc(name, [str(SHOAL_BIN), *args], logs / f"{name}.log").start(env)
    try:
        await wait_for(
            cluster,
            lambda: "resuming after seq" in cluster.parts["projector"].log(),
            "the projector to start",
        )
        async with httpx.AsyncClient(base_url=cluster.api_url, timeout=10.0) as client:

            async def healthy() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get("/healthz")).status_code == 200
                return False

            await wait_for_async(cluster, healthy, "the API to answer /healthz")
            created = await asyncio.to_thread(
                subprocess.run,
                [
                    str(SHOAL_BIN),
                    "instances",
                    "create",
                    MODEL_ID,
                    "--id",
                    "soak",
                    *common,
                    "--db",
                    db,
                    "--wait",
                    "60",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=180,
            )
            if created.returncode != 0:
                raise RuntimeError(f"shoal instances create failed:\n{created.stderr}")

            async def serving() -> bool:
                r = await client.get("/v1/instances")
                return any(
                    s.get("state") in ("Ready", "Running")
                    for i in r.json().get("data", [])
                    for s in i.get("shards", [])
                )

            await wait_for_async(cluster, serving, "a runner of the model to be ready")
    except BaseException:
        for line in cluster.stop():
            print(line, file=sys.stderr)
        for part in cluster.parts.values():
            sys.stderr.write(f"--- {part.name} ({part.log_path})\n{part.log()[-2000:]}\n")
        raise
    return cluster


async def wait_for(cluster: Cluster, ready: Callable[[], bool], what: str) -> None:
    async def check() -> bool:
        return bool(ready())

    await wait_for_async(cluster, check, what)


async def wait_for_async(cluster: Cluster, ready: Callable[[], Awaitable[bool]], what: str) -> None:
    """Until ``ready()``; a RuntimeError if a part exits or READY_TIMEOUT passes first."""

    def alive() -> None:
        for part in cluster.parts.values():
            part.check_running()

    await wait_until(
        ready, alive, READY_TIMEOUT, 0.2, lambda: f"no {what} within {READY_TIMEOUT:.0f} s"
    )
