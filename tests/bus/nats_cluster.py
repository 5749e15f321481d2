"""A NATS cluster for tests: three (or more) embedded nats-servers with JetStream, routed to
each other, each with its own name and store directory, each on a test host of its own
(``harness/hosts.py``: its own address, as on separate machines)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

import nats.errors
from nats.aio.client import Client
from nats.js.api import StreamInfo
from nats.js.errors import Error as JetStreamError

from bus.connection import connect
from bus.embedded import EmbeddedNats
from harness.hosts import Network

CLIENT_PORT = 4222
CLUSTER_PORT = 6222


class NatsCluster:
    """``async with NatsCluster(dir, net) as cluster`` runs a server on each host until exit,
    and enters once JetStream answers (the servers have elected a meta leader). Server ``i`` (on
    host ``i``) is named ``n<i>``; ``urls_from(i)`` lists every server's client URL with server
    ``i`` first."""

    def __init__(self, base_dir: Path, net: Network, name: str = "shoal") -> None:
        """A server on each of ``net``'s hosts, on the usual ports (each host has its own)."""
        self.net = net
        routes = [f"nats://{h.address}:{CLUSTER_PORT}" for h in net.hosts]
        self.servers = [
            EmbeddedNats(
                base_dir / f"n{i}",
                port=CLIENT_PORT,
                host=h.address,
                server_name=f"n{i}",
                cluster_name=name,
                cluster_port=CLUSTER_PORT,
                routes=routes,
                launcher=h.argv,
            )
            for i, h in enumerate(net.hosts)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def urls_from(self, i: int) -> str:
        """All client URLs, comma-separated, server ``i`` first (then the others in order): a
        client given these connects to server ``i`` while it is up."""
        n = len(self.servers)
        return ",".join(self.servers[(i + k) % n].url for k in range(n))

    @property
    def url(self) -> str:
        return self.urls_from(0)

    def index_of(self, url_or_name: str) -> int:
        """Which server a client URL (``nats://10.77.N.I:4222``) or a server name is."""
        for i, s in enumerate(self.servers):
            if url_or_name in (s.url, s.server_name):
                return i
        raise KeyError(url_or_name)

    def start(self) -> None:
        for s in self.servers:
            s.start()

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    async def wait_jetstream(self, timeout: float = 30.0) -> None:
        """Until JetStream answers through every running server (a meta leader is elected)."""
        async with asyncio.timeout(timeout):
            for s in self.servers:
                if s._proc is None:
                    continue
                nc = await connect(s.url, name="cluster-check")
                try:
                    while True:
                        with contextlib.suppress(nats.errors.Error, JetStreamError):
                            await nc.jetstream(timeout=1.0).account_info()
                            break
                        await asyncio.sleep(0.1)
                finally:
                    await nc.close()

    async def __aenter__(self) -> NatsCluster:
        try:
            await asyncio.to_thread(self.start)
            await self.wait_jetstream()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)


async def stream_info(nc: Client, stream: str, timeout: float = 30.0) -> StreamInfo:
    """The stream's info, asking again while it has no leader to answer (after its leader's
    server was lost, for a few seconds)."""
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(nats.errors.Error, JetStreamError):
                return await nc.jetstream(timeout=1.0).stream_info(stream)
            await asyncio.sleep(0.1)


async def make_leader(nc: Client, stream: str, server_name: str, timeout: float = 30.0) -> None:
    """Move the leadership of ``stream`` to ``server_name`` (a replica that is up to date).
    Asked again only once the election the last request started has ended: a step-down asked
    while one is under way starts another, and on a loaded machine that never ends."""

    async def leader() -> str | None:
        info = await stream_info(nc, stream)
        return info.cluster.leader if info.cluster is not None else None

    subject = f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}"
    await _move_leader(nc, leader, subject, server_name, timeout)


async def _move_leader(
    nc: Client,
    leader: Callable[[], Awaitable[str | None]],
    subject: str,
    server_name: str,
    timeout: float,
) -> None:
    request = json.dumps({"placement": {"preferred": server_name}}).encode()
    async with asyncio.timeout(timeout):
        while (old := await leader()) != server_name:
            if old is None:  # an election is under way
                await asyncio.sleep(0.2)
                continue
            with contextlib.suppress(nats.errors.Error, JetStreamError):
                await nc.request(subject, request, timeout=1.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10.0):
                    while await leader() in (old, None):
                        await asyncio.sleep(0.2)


async def make_consumer_leader(
    nc: Client, stream: str, consumer: str, server_name: str, timeout: float = 30.0
) -> None:
    """Move the leadership of a durable consumer (replicated like its stream) to
    ``server_name``."""

    async def leader() -> str | None:
        while True:
            with contextlib.suppress(nats.errors.Error, JetStreamError):
                info = await nc.jetstream(timeout=1.0).consumer_info(stream, consumer)
                return info.cluster.leader if info.cluster is not None else None
            await asyncio.sleep(0.1)

    subject = f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}"
    await _move_leader(nc, leader, subject, server_name, timeout)
