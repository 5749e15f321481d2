"""An API to test against: real nats-server, projector and `shoal api` processes (no runner:
tests that need one start `shoal up`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bus.embedded import EmbeddedNats, free_port
from harness.processes import Processes, wait_healthy
from tests.api.up_cluster import up_cluster

__all__ = ["ApiStack", "run_sync", "running_api_stack", "up_cluster"]

T = TypeVar("T")


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


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on its own loop in another thread, so that synchronous
    fixtures and tests can use the async helpers whatever pytest-asyncio's loop is doing."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


@contextlib.contextmanager
def running_api_stack(root: Path) -> Iterator[ApiStack]:
    """What ``api_stack`` runs, for synchronous code and wider scopes: a module whose tests
    change nothing the others read (each may start APIs of its own beside it, under its own
    names) starts it once, as a module fixture named ``api_stack``."""
    with EmbeddedNats(root / "nats") as nats_server, Processes(root / "logs") as procs:
        db = f"sqlite:///{root / 'shoal.db'}"
        procs.start("projector", "projector", "--nats", nats_server.url, "--db", db)
        run_sync(procs.wait_log("projector", "resuming after seq"))
        stack = ApiStack("", nats_server.url, db, procs)
        stack.url = stack.start_api("api")
        run_sync(wait_healthy(stack.url))
        yield stack
