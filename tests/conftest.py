"""Fixtures: a real nats-server per test, and real SQLite / PostgreSQL databases."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.streams import ensure_streams
from projectors import database

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


async def _admin(url: str) -> asyncpg.Connection:
    u = make_url(url)
    return await asyncpg.connect(
        host=u.host, port=u.port or 5432, user=u.username, password=u.password, database=u.database
    )


MakeDb = Callable[[], Awaitable[str]]


@pytest.fixture(params=["sqlite", "postgresql"])
def make_db(request: pytest.FixtureRequest, tmp_path: Path) -> MakeDb:
    """Makes new, empty databases of one kind: SQLite files, or PostgreSQL databases created
    for this test on the server named by SHOAL_TEST_POSTGRES_URL (skipped when not set).
    Tests that take it run on both kinds."""
    kind: str = request.param
    if kind == "postgresql" and not os.environ.get(POSTGRES_ENV):
        pytest.skip(f"{POSTGRES_ENV} is not set")

    async def make() -> str:
        if kind == "sqlite":
            return f"sqlite:///{tmp_path / f'projection-{uuid.uuid4().hex[:8]}.db'}"
        return await _new_postgres_db()

    return make


@pytest.fixture
async def db_url(make_db: MakeDb) -> str:
    return await make_db()


async def _new_postgres_db() -> str:
    base = os.environ[POSTGRES_ENV]
    name = f"shoal_test_{uuid.uuid4().hex[:12]}"
    conn = await _admin(base)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    _CREATED.append(name)
    return make_url(base).set(database=name).render_as_string(hide_password=False)


_CREATED: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def _drop_postgres_databases() -> Iterator[None]:
    yield
    base = os.environ.get(POSTGRES_ENV)
    if not base or not _CREATED:
        return

    async def drop() -> None:
        conn = await _admin(base)
        try:
            for name in _CREATED:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = database.create_engine(db_url)
    yield eng
    await eng.dispose()
