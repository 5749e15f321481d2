"""Nats-servers routed into one cluster, each on a test host of its own: three (or more)
embedded nats-servers with JetStream, each with its own name and store directory and the
address of its host (``harness/hosts.py``: as on separate machines)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import TracebackType

import nats.errors
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
