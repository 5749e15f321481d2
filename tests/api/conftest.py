"""An API to test against: real nats-server, projector and `shoal api` processes (no runner:
tests that need one start `shoal up`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bus.embedded import EmbeddedNats, free_port
from tests.api.up_cluster import up_cluster
from tests.cli.shoal_up import wait_healthy
from tests.services.processes import Processes

__all__ = ["ApiStack", "up_cluster", "wait_healthy"]


@dataclass
class ApiStack:
    url: str  # http://127.0.0.1:PORT
    nats_url: str
    db_url: str
    procs: Processes

    def start_api(self, name: str, *extra: str, load_on_demand: bool = False) -> str:
        """Another `shoal api` process on the same NATS and database; returns its URL. Without
        loading models on demand unless asked: these stacks' nodes are events, with no worker
        to load one (what a load asks for, or why it cannot be placed, is what such a test
        sees)."""
        port = free_port("127.0.0.1")
        self.procs.start(
            name,
            "api",
            "--nats",
            self.nats_url,
            "--db",
            self.db_url,
            "--port",
            str(port),
            "--load-on-demand" if load_on_demand else "--no-load-on-demand",
            *extra,
        )
        return f"http://127.0.0.1:{port}"


@pytest.fixture
async def api_stack(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[ApiStack]:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    with Processes(tmp_path / "logs") as procs:
        procs.start("projector", "projector", "--nats", nats_server.url, "--db", db)
        await procs.wait_log("projector", "resuming after seq")
        stack = ApiStack("", nats_server.url, db, procs)
        stack.url = stack.start_api("api")
        await wait_healthy(stack.url)
        yield stack
