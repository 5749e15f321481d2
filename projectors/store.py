"""Reading the projection into memory and writing row changes to it (the SQL edge)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from sqlalchemy import Table, delete, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from projectors.rows import ROW_TYPES, Row
from projectors.state import Change, ClusterState, Put, collapse
from projectors.tables import STATE_TABLES, projector_offsets

ROW_TYPE_BY_TABLE: dict[str, type[Row]] = {t.TABLE: t for t in ROW_TYPES}
_FIELDS: dict[str, tuple[str, ...]] = {t.TABLE: tuple(f.name for f in fields(t)) for t in ROW_TYPES}


def row_values(row: Row) -> dict[str, Any]:
    return {name: getattr(row, name) for name in _FIELDS[row.TABLE]}


def _upsert(conn: AsyncConnection, table: Table) -> Any:
    insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = insert(table)
    pk = [c.name for c in table.primary_key.columns]
    updates = {c.name: stmt.excluded[c.name] for c in table.columns if c.name not in pk}
    return stmt.on_conflict_do_update(index_elements=pk, set_=updates)


async def load_state(conn: AsyncConnection, tables: Iterable[str] | None = None) -> ClusterState:
    """The projection in memory: every table, or only ``tables`` (the others stay empty)."""
    state = ClusterState()
    for name in tables if tables is not None else STATE_TABLES:
        table = STATE_TABLES[name]
        row_type = ROW_TYPE_BY_TABLE[name]
        result = await conn.execute(select(table))
        rows = state.tables[name]
        for r in result.mappings():
            row = row_type(**r)
            rows[row.key()] = row
    return state


async def write_changes(conn: AsyncConnection, changes: Iterable[Change]) -> int:
    """Write the net effect of ``changes`` (last change per row wins). Returns rows written."""
    puts: dict[str, list[dict[str, Any]]] = {}
    deletes: dict[str, list[tuple[Any, ...]]] = {}
    for ch in collapse(changes).values():
        if isinstance(ch, Put):
            puts.setdefault(ch.table, []).append(row_values(ch.row))
        else:
            deletes.setdefault(ch.table, []).append(ch.key)
    for name, keys in deletes.items():
        table = STATE_TABLES[name]
        pk = tuple(table.primary_key.columns)
        for i in range(0, len(keys), 500):
            await conn.execute(delete(table).where(tuple_(*pk).in_(keys[i : i + 500])))
    for name, values in puts.items():
        await conn.execute(_upsert(conn, STATE_TABLES[name]), values)
    return sum(len(v) for v in puts.values()) + sum(len(k) for k in deletes.values())


async def read_offset(conn: AsyncConnection, projector: str, stream: str) -> int:
    t = projector_offsets
    q = select(t.c.last_seq).where(t.c.projector == projector, t.c.stream == stream)
    seq = (await conn.execute(q)).scalar_one_or_none()
    return int(seq) if seq is not None else 0


async def write_offset(conn: AsyncConnection, projector: str, stream: str, seq: int) -> None:
    values: Mapping[str, Any] = {"projector": projector, "stream": stream, "last_seq": seq}
    await conn.execute(_upsert(conn, projector_offsets), [values])


async def table_rows(conn: AsyncConnection, name: str) -> list[dict[str, Any]]:
    """Every row of a state table in key order: for comparing projections and `shoal state`."""
    table = STATE_TABLES[name]
    result = await conn.execute(select(table).order_by(*table.primary_key.columns))
    return [dict(r) for r in result.mappings()]
