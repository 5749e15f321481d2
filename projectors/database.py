"""Opening the projection database and bringing its schema up to date."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).parent


class DatabaseUrlError(ValueError):
    pass


def async_url(url: str) -> URL:
    """Accept plain URLs (``sqlite:///x.db``, ``postgresql://...``) and pick the async driver."""
    try:
        u = make_url(url)
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
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


async def upgrade(engine: AsyncEngine, revision: str = "head") -> None:
    """Apply the Alembic migrations up to ``revision``. Idempotent."""
    async with engine.begin() as conn:
        await conn.run_sync(lambda c: command.upgrade(_alembic_config(c), revision))


async def current_revision(engine: AsyncEngine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
