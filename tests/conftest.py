"""Fixtures: a real nats-server per test, and real SQLite / PostgreSQL databases."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.streams import ensure_streams
from projectors import database
from tests.databases import ScratchDatabases

POSTGRES_ENV = "SHOAL_TEST_POSTGRES_URL"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A fresh nats-server with JetStream on a free port (never the system one on 4222)."""
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, name="test")
    yield client
    await client.close()


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    context = nc.jetstream()
    await ensure_streams(context)
    return context


MakeDb = Callable[[], Awaitable[str]]


@pytest.fixture(scope="session")
def scratch_databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScratchDatabases]:
    dbs = ScratchDatabases(
        tmp_path_factory.mktemp("databases"), os.environ.get(POSTGRES_ENV), prefix="shoal_test"
    )
    yield dbs
    asyncio.run(dbs.cleanup())


@pytest.fixture(params=["sqlite", "postgresql"])
def make_db(request: pytest.FixtureRequest, scratch_databases: ScratchDatabases) -> MakeDb:
    """Makes new, empty databases of one kind: SQLite files, or PostgreSQL databases created
    on the server named by SHOAL_TEST_POSTGRES_URL (skipped when not set) and dropped at the end
    of the session. Tests that take it run on both kinds."""
    kind: str = request.param
    if kind == "postgresql" and not os.environ.get(POSTGRES_ENV):
        pytest.skip(f"{POSTGRES_ENV} is not set")

    async def make() -> str:
        return await scratch_databases.new(kind, "projection")

    return make


@pytest.fixture
async def db_url(make_db: MakeDb) -> str:
    return await make_db()


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = database.create_engine(db_url)
    yield eng
    await eng.dispose()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests not marked slow first (in their order), then the slow ones: a failure of the
    pure logic shows in seconds, not after the end-to-end runs."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
