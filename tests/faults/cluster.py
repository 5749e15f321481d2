"""A small Shoal cluster of real processes for the fault tests: an embedded nats-server, and
`shoal projector`, `shoal planner`, `shoal worker` and `shoal api` processes started, stopped
and killed one by one, each logging to ``<tmp>/logs/<name>.log``.

With ``hosts``, each worker runs on a test host of its own (``harness/hosts.py``): its own
address, its machine killed whole by ``lose``; NATS and the other services stay on this machine,
which the hosts reach across their bridge (NATS listens on the bridge's address).

The test keeps its own NATS connection (to publish, and to watch the log through
``EventLog``) and reads the projection database directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, ensure_streams
from cli.models import publish_model
from events.catalogue import InstancePlaced, InstanceRequested, NodeJoined, RunnerStateChanged
from harness.hosts import Host, Network
from harness.processes import Processes, wait_healthy
from projectors import database
from projectors.rows import RunnerRow, TaskRow
from projectors.store import load_state, read_offset
from services.models.catalogue import builtin_cards
from tests.services.event_log import EventLog

MODEL = "smollm2-135m"
PROJECTOR = "main"  # the projector's name: its tracking row
SERVING = ("Ready", "Running")


@dataclass
class Cluster:
    tmp: Path
    nats: EmbeddedNats  # restarted on the same port and store by restart_nats
    procs: Processes
    nc: Client
    js: JetStreamContext
    log: EventLog
    engine: AsyncEngine  # the projection, read by the test
    db_url: str
    apis: dict[str, str] = field(default_factory=dict)  # process name -> base URL
    projector: str | None = None  # the name of the live projector process
    kinds: dict[str, str] = field(default_factory=dict)  # process name -> shoal command
    net: Network | None = None  # the test hosts the workers run on, if any
    hosts: dict[str, Host] = field(default_factory=dict)  # worker name -> its host

    # --- processes ----------------------------------------------------------------------

    async def start_projector(self, name: str = "projector") -> None:
        self.kinds[name] = "projector"
        self.procs.start(
            name, "projector", "--nats", self.nats.url, "--db", self.db_url, "--name", PROJECTOR
        )
        self.projector = name
        await self.procs.wait_log(name, "resuming after seq", timeout=60)

    def start_planner(self, name: str = "planner") -> None:
        self.kinds[name] = "planner"
        self.procs.start(name, "planner", "--nats", self.nats.url, "--db", self.db_url)

    async def start_worker(
        self, node: str, memory_limit: str | None = None, heartbeat: float = 1.0
    ) -> None:
        limit = ["--memory-limit", memory_limit] if memory_limit else []
        self.kinds[node] = "worker"
        host = None
        if self.net is not None:
            host = self.hosts[node] = self.net.hosts[len(self.hosts)]
        self.procs.start(
            node,
            "worker",
            "--nats",
            self.nats.url,
            "--node-id",
            node,
            "--data-dir",
            str(self.tmp / node),
            "--heartbeat",
            str(heartbeat),
            "--runner-threads",
            "1",
            *limit,
            host=host,
        )
        await self.log.wait_for(NodeJoined, lambda e: e.node_id == node, timeout=60)

    async def start_api(self, name: str = "api") -> str:
        port = free_port("127.0.0.1")
        self.kinds[name] = "api"
        self.procs.start(
            name, "api", "--nats", self.nats.url, "--db", self.db_url, "--port", str(port)
        )
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, timeout=60)
        self.apis[name] = url
        return url

    async def stop(self, name: str, timeout: float = 30) -> int:
        """SIGTERM, as an operator stops a service; its exit code."""
        proc = self.procs.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, timeout)
        if name == self.projector:
            self.projector = None
        return code

    def kill(self, name: str) -> None:
        self.procs.kill(name)
        if name == self.projector:
            self.projector = None

    def lose(self, node: str) -> None:
        """A worker's machine dies: every process on its host (worker, runners) at once."""
        self.hosts[node].kill()

    async def stop_all_but_projector(self) -> None:
        """Stop every service that publishes, so that the log stops growing: the APIs, then
        the planners (which would react to the workers leaving), then the workers and so their
        runners. The projector stays, to catch up."""
        for kind in ("api", "planner", "worker"):
            names = [
                n for n, k in self.kinds.items() if k == kind and self.procs.procs[n].poll() is None
            ]
            await asyncio.gather(*(self.stop(n) for n in names))

    # --- the model and its instances ----------------------------------------------------

    async def add_model(self) -> None:
        await publish_model(self.js, builtin_cards()[MODEL], self.tmp / "models", lambda _: None)

    async def request_instance(self, instance_id: str, replicas: int = 1) -> None:
        await Publisher(self.js).publish(
            InstanceRequested(
                instance_id=instance_id, model_id=MODEL, origin="test", replicas=replicas
            )
        )

    async def wait_serving(self, instance_id: str, timeout: float = 90) -> RunnerStateChanged:
        """Until a runner of the latest placement of ``instance_id`` is serving, in the log and
        in the projection (which the API reads); that runner's latest Ready event (its pid)."""
        async with asyncio.timeout(timeout):
            while not (serving := await self.serving(instance_id)):
                await asyncio.sleep(0.1)
        return serving[0]

    async def serving(self, instance_id: str) -> list[RunnerStateChanged]:
        """The latest Ready event of each runner of the latest placement of ``instance_id``
        that is serving now, in the log and in the projection."""
        placed = self.log.of(InstancePlaced, lambda e: e.instance_id == instance_id)
        shards = {s.runner_id for s in placed[-1].shards} if placed else set()
        latest: dict[str, RunnerStateChanged] = {}
        ready: dict[str, RunnerStateChanged] = {}
        for e in self.log.of(RunnerStateChanged):
            if e.runner_id not in shards:
                continue
            latest[e.runner_id] = e
            if e.state == "Ready":
                ready[e.runner_id] = e
        # Its latest state, not an earlier Ready: a runner may have died since.
        return [
            ready[runner_id]
            for runner_id, e in latest.items()
            if e.state in SERVING and await self.runner_state(runner_id) in SERVING
        ]

    # --- the projection -----------------------------------------------------------------

    async def runner(self, runner_id: str) -> RunnerRow | None:
        async with self.engine.connect() as conn:
            state = await load_state(conn, [RunnerRow.TABLE])
        return state.runner(runner_id)

    async def task(self, task_id: str) -> TaskRow | None:
        async with self.engine.connect() as conn:
            state = await load_state(conn, [TaskRow.TABLE])
        return state.task(task_id)

    async def runner_state(self, runner_id: str) -> str | None:
        row = await self.runner(runner_id)
        return row.state if row is not None else None

    async def applied_seq(self) -> int:
        try:
            async with self.engine.connect() as conn:
                return await read_offset(conn, PROJECTOR, EVENTS_STREAM)
        except Exception:  # not migrated yet: the projector has applied nothing
            return 0

    async def last_seq(self) -> int:
        return (await self.js.stream_info(EVENTS_STREAM)).state.last_seq

    async def wait_applied(self, seq: int, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while await self.applied_seq() < seq:
                await asyncio.sleep(0.05)

    # --- the server ---------------------------------------------------------------------

    async def restart_nats(self, sig: signal.Signals, down_s: float = 0.0) -> None:
        """Stop the server (SIGTERM: a clean shutdown; SIGKILL: a crash), leave it down for
        ``down_s``, and start it again on the same port with the same store."""
        if sig == signal.SIGKILL:
            self.nats.kill()
        else:
            await asyncio.to_thread(self.nats.stop)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.nats.start)

    async def fresh_log(self) -> None:
        """Watch the log afresh, from its start: after a server restart the old watcher's
        ordered consumers are gone, and nats-py notices that only after missed heartbeats."""
        with contextlib.suppress(Exception):
            await self.log.stop()
        self.log = await EventLog().start(self.js)


@contextlib.asynccontextmanager
async def running_cluster(tmp: Path, hosts: int = 0) -> AsyncIterator[Cluster]:
    """A nats-server and the test's connection to it; the test starts the services (workers on
    ``hosts`` test hosts, when given). On the way out every process is stopped (SIGTERM, then
    SIGKILL) and the tails of their logs and of the runners' logs are printed (pytest shows
    them when the test failed)."""
    async with contextlib.AsyncExitStack() as stack:
        net = stack.enter_context(Network(tmp / "hosts", hosts)) if hosts else None
        async with _cluster(tmp, net) as c:
            yield c


@contextlib.asynccontextmanager
async def _cluster(tmp: Path, net: Network | None) -> AsyncIterator[Cluster]:
    nats = EmbeddedNats(tmp / "nats", host=net.gateway if net is not None else "127.0.0.1")
    nats.start()
    db_url = f"sqlite:///{tmp / 'shoal.db'}"
    engine = database.create_engine(db_url)
    env = {**os.environ, "SHOAL_DATA_DIR": str(tmp / "shoal-home")}
    try:
        nc = await connect(nats.url, name="fault-test")
        js = nc.jetstream()
        await ensure_streams(js)
        c = Cluster(
            tmp,
            nats,
            Processes(tmp / "logs", env),
            nc,
            js,
            await EventLog().start(js),
            engine,
            db_url,
            net=net,
        )
        try:
            with c.procs:
                yield c
        finally:
            with contextlib.suppress(Exception):
                await c.log.stop()
            await nc.close()
            _print_runner_logs(tmp)
    finally:
        await engine.dispose()
        nats.stop()


def _print_runner_logs(tmp: Path) -> None:
    for path in sorted(tmp.glob("*/logs/runner-*.log")):
        text = path.read_text(errors="replace")[-2000:]
        sys.stdout.write(f"--- {path.parent.parent.name}/{path.name}\n{text}\n")
