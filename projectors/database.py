"""Opening the projection database and bringing its schema up to date."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

import migrations
from projectors.db_url import absolute_db_url

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(migrations.__file__).parent


# How long a projector waits for another one's hold on the database to go: a process killed a
# moment ago may still hold it (PostgreSQL ends its session once it notices).
HOLD_WAIT_S = 5.0


class DatabaseUrlError(ValueError):
    pass


class ProjectorRunning(RuntimeError):
    """Another projector of the same name holds this database."""


def async_url(url: str) -> URL:
    """Accept plain URLs (``sqlite:///x.db``, ``postgresql://...``) and pick the async driver."""
    try:
        u = make_url(absolute_db_url(url))
    except ArgumentError as exc:
        raise DatabaseUrlError(f"not a database URL: {url!r}") from exc
    if u.drivername in ("sqlite", "sqlite+pysqlite"):
        u = u.set(drivername="sqlite+aiosqlite")
    elif u.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+asyncpg")
    if u.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
        raise DatabaseUrlError(f"unsupported database URL {url!r}: use sqlite:/// or postgresql://")
    return u


def create_engine(url: str) -> AsyncEngine:
    u = async_url(url)
    if u.drivername.startswith("sqlite"):
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(u, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: object, _record: ConnectionPoolEntry) -> None:
            # WAL lets readers (API, planner, `shoal state`) read while the projector writes.
            cur = dbapi_conn.cursor()  # type: ignore[attr-defined]
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_async_engine(u, pool_pre_ping=True)


def sqlite_reader(url: str) -> Engine | None:
    """For a SQLite projection, a plain (not async) engine on the same file, for a reader that
    wants a query done in one hop to a worker thread: through aiosqlite every step of a query
    (connect, execute, fetch, reset) is a hop of its own. None for other databases."""
    u = async_url(url)
    if not u.drivername.startswith("sqlite") or u.database in (None, "", ":memory:"):
        return None
    plain = u.set(drivername="sqlite+pysqlite")
    return sqlalchemy.create_engine(plain, connect_args={"timeout": 30})


def _alembic_config(connection: Connection) -> Config:
    # Alembic is imported where it is used: only a projector, a replay and `shoal db` migrate,
    # and the API and planner processes, which only read the database, need not import it.
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Apply the Alembic migrations up to ``revision``. Idempotent."""
    from alembic import command

    async with engine.begin() as conn:
        await conn.run_sync(lambda c: command.upgrade(_alembic_config(c), revision))


# Alembic's version table, made once: a MigrationContext makes a new Table at each use, and
# each then compiled its query anew into the engine's statement cache (a projector asks at
# every snapshot, and its memory grew by an entry each time).
_VERSIONS = sqlalchemy.Table(
    "alembic_version",
    sqlalchemy.MetaData(),
    sqlalchemy.Column("version_num", sqlalchemy.String(32), primary_key=True),
)


def revision_of(conn: Connection) -> str | None:
    """The schema revision of the database ``conn`` is on (None: not made by Alembic yet)."""
    if not sqlalchemy.inspect(conn).has_table(_VERSIONS.name):
        return None
    return conn.execute(sqlalchemy.select(_VERSIONS.c.version_num)).scalar_one_or_none()


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(revision_of)


@contextlib.asynccontextmanager
async def projector_hold(
    engine: AsyncEngine, name: str, wait_s: float = HOLD_WAIT_S
) -> AsyncIterator[None]:
    """Hold the database for the projector ``name`` while the block runs, or raise
    ``ProjectorRunning`` when another process (or another projector in this one) holds it
    after ``wait_s``: a second projector fails at once instead of taking the first one's
    consumer. PostgreSQL: a session advisory lock; SQLite: ``flock`` on a file beside the
    database. Both go with the process that holds them, however it ends. (The tracking row's
    compare-and-set catches what this cannot: a hold lost with its PostgreSQL connection.)"""
    if engine.dialect.name == "postgresql":
        async with _advisory_lock(engine, name, wait_s):
            yield
        return
    database = engine.url.database
    if not database or database == ":memory:":
        yield  # a database of its process alone
        return
    path = Path(f"{database}.projector-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    async def take() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    try:
        await _retry(take, wait_s, f"projector {name!r} already runs on {database}")
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.asynccontextmanager
async def _advisory_lock(engine: AsyncEngine, name: str, wait_s: float) -> AsyncIterator[None]:
    digest = hashlib.sha256(f"shoal-projector:{name}".encode()).digest()
    key = int.from_bytes(digest[:8], "big", signed=True)
    conn = await engine.connect()
    try:

        async def take() -> bool:
            taken = await conn.scalar(text("SELECT pg_try_advisory_lock(:key)"), {"key": key})
            await conn.commit()  # a session lock: no transaction left open while it is held
            return bool(taken)

        await _retry(take, wait_s, f"projector {name!r} already runs on this database")
        yield
    finally:
        try:
            await conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
            await conn.commit()
            await conn.close()
        except Exception:
            # The pool would keep the session, and the lock with it: close it for good.
            await conn.invalidate()


async def _retry(take: Callable[[], Awaitable[bool]], wait_s: float, refusal: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not await take():
        if loop.time() >= deadline:
            raise ProjectorRunning(refusal)
        await asyncio.sleep(0.2)
