"""Reading and writing rows by key (projectors/store.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from projectors import database
from projectors.rows import KeyRow
from projectors.state import Delete, Put
from projectors.store import KEY_CHUNK, key_chunks, read_rows, write_changes


def test_key_chunks_hold_every_key_in_lists_of_a_power_of_two() -> None:
    for n in (1, 2, 3, 7, 100, KEY_CHUNK, KEY_CHUNK + 1, 3 * KEY_CHUNK - 5):
        keys = list(range(n))
        chunks = list(key_chunks(keys))
        assert sorted(set().union(*chunks)) == keys
        assert all(len(c) <= KEY_CHUNK and len(c) & (len(c) - 1) == 0 for c in chunks)
        # Padding repeats a chunk's own last key, so that no chunk names another's keys.
        assert sum(len(set(c)) for c in chunks) == n
    assert list(key_chunks([])) == []


def _key(i: int) -> KeyRow:
    return KeyRow(key_id=f"k{i}", name=f"key {i}", role="user", digest=f"d{i}")


async def test_any_number_of_keys_takes_a_few_statement_shapes(engine: AsyncEngine) -> None:
    """SQLite and asyncpg keep every statement they prepared, per connection: a statement
    for each length of key list held megabytes in a long-running projector."""
    await database.upgrade(engine)
    statements: set[str] = set()

    def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.add(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", seen)
    async with engine.begin() as conn:
        await write_changes(conn, [Put(_key(i)) for i in range(0, 700, 2)])
    for n in range(1, 700, 7):
        async with engine.begin() as conn:
            rows = await read_rows(conn, KeyRow.TABLE, [(f"k{i}",) for i in range(n)])
            assert sorted(r.key() for r in rows) == sorted((f"k{i}",) for i in range(0, n, 2))
    async with engine.begin() as conn:
        for n in range(1, 302, 3):  # the last deletes k0..k300
            await write_changes(conn, [Delete(KeyRow.TABLE, (f"k{i}",)) for i in range(n)])
        assert await read_rows(conn, KeyRow.TABLE, [(f"k{i}",) for i in range(300)]) == []
        left = await read_rows(conn, KeyRow.TABLE, [(f"k{i}",) for i in range(700)])
        assert len(left) == len(range(302, 700, 2))
    selects = {s for s in statements if s.lstrip().startswith("SELECT")}
    deletes = {s for s in statements if s.lstrip().startswith("DELETE")}
    assert 0 < len(selects) <= 10 and 0 < len(deletes) <= 10
