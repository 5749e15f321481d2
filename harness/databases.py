"""Fresh, empty databases for tests and benchmarks: SQLite files in a directory, or PostgreSQL
databases created on a server and dropped again by ``cleanup``."""

from __future__ import annotations

import uuid
from pathlib import Path

import asyncpg
from sqlalchemy.engine import make_url


async def _admin(url: str) -> asyncpg.Connection:
    u = make_url(url)
    return await asyncpg.connect(
        host=u.host, port=u.port or 5432, user=u.username, password=u.password, database=u.database
    )


class ScratchDatabases:
    def __init__(self, directory: Path, postgres_url: str | None, prefix: str = "shoal") -> None:
        self._dir = directory
        self._postgres_url = postgres_url
        self._prefix = prefix
        self._created: list[str] = []

    async def new(self, backend: str, label: str = "db") -> str:
        suffix = uuid.uuid4().hex[:8]
        if backend == "sqlite":
            return f"sqlite:///{self._dir / f'{label}-{suffix}.db'}"
        if self._postgres_url is None:
            raise RuntimeError("no PostgreSQL server configured")
        name = f"{self._prefix}_{label}_{suffix}"
        conn = await _admin(self._postgres_url)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        self._created.append(name)
        return make_url(self._postgres_url).set(database=name).render_as_string(False)

    async def cleanup(self) -> None:
        if not self._created or self._postgres_url is None:
            return
        conn = await _admin(self._postgres_url)
        try:
            for name in self._created:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()
        self._created.clear()
