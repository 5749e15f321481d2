"""Reading the projection into memory and writing row changes to it (the SQL edge)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    Integer,
    String,
    Table,
    delete,
    func,
    null,
    select,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from events.states import TASK_ENDED
from projectors.rows import ROW_TYPES, ResponseRow, Row, TaskRow
from projectors.state import Change, ClusterState, Put, collapse
from projectors.tables import (
    STATE_TABLES,
    UtcDateTime,
    event_counts,
    projector_offsets,
    tasks,
)

K = TypeVar("K")

ROW_TYPE_BY_TABLE: dict[str, type[Row]] = {t.TABLE: t for t in ROW_TYPES}
_FIELDS: dict[str, tuple[str, ...]] = {t.TABLE: tuple(f.name for f in fields(t)) for t in ROW_TYPES}


def row_values(row: Row) -> dict[str, Any]:
    return {name: getattr(row, name) for name in _FIELDS[row.TABLE]}


class UnstorableError(ValueError):
    """A row the projection cannot hold on every supported database."""


Check = Callable[[Any], str | None]  # why a value cannot be stored in a column, or None


def _time_problem(value: Any) -> str | None:
    if not isinstance(value, datetime) or value.tzinfo is None:
        return "a time without a time zone"
    if 1 < value.year < 9999:
        return None  # in range in UTC whatever its offset (converting it costs more)
    try:
        value.astimezone(UTC)
    except OverflowError:
        return f"{value.isoformat()} is out of range"
    return None


def _float_problem(value: Any) -> str | None:
    return None if math.isfinite(value) else f"{value} is not a finite number"


def _json_problem(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} in JSON"
    if isinstance(value, list):
        return next((p for v in value if (p := _json_problem(v))), None)
    if isinstance(value, dict):
        return next((p for v in value.values() if (p := _json_problem(v))), None)
    return None


def _column_check(column: Column[Any]) -> Check | None:
    """What SQLite and PostgreSQL alike can store in ``column``. Checked before writing, so
    that an event with such a value is set aside like a malformed one rather than failing its
    batch again and again (and so that both databases hold the same rows). None: any value of
    the column's type fits."""
    kind = column.type
    check: Check
    if isinstance(kind, UtcDateTime):
        check = _time_problem
    elif isinstance(kind, Integer):
        bits = 64 if isinstance(kind, BigInteger) else 32
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)

        def check(v: Any) -> str | None:
            return None if low <= v < high else f"{v} does not fit in {bits} bits"

    elif isinstance(kind, Float):
        check = _float_problem
    elif isinstance(kind, String):  # Text too
        length = kind.length

        def check(v: Any) -> str | None:
            if "\x00" in v:
                return "contains a NUL character"
            if length is not None and len(v) > length:
                return f"{len(v)} characters, more than {length}"
            return None

    elif isinstance(kind, JSON):
        check = _json_problem
    else:
        return None
    return check


# Per table, the columns a value could be wrong for: (name, its check or None, nullable). A
# nullable column of a type any value fits is left out: every event's rows pass through here.
_CHECKS: dict[str, list[tuple[str, Check | None, bool]]] = {
    name: [
        (c.name, check, bool(c.nullable))
        for c in table.columns
        if (check := _column_check(c)) is not None or not c.nullable
    ]
    for name, table in STATE_TABLES.items()
}


def check_storable(changes: Iterable[Change]) -> None:
    """Raise UnstorableError naming the first column whose value these changes cannot store."""
    for ch in changes:
        if isinstance(ch, Put):
            row = ch.row
            for name, check, nullable in _CHECKS[ch.table]:
                value = getattr(row, name)
                if value is None:
                    problem = None if nullable else "missing (NOT NULL)"
                else:
                    problem = check(value) if check is not None else None
                if problem:
                    raise UnstorableError(f"{ch.table}.{name}: {problem}")


def _upsert(conn: AsyncConnection, table: Table) -> Any:
    return _upsert_statement(conn.dialect.name, table)


# Built once per table: building it (``excluded`` makes a column proxy per column) was most of
# the projector's CPU, which on a small machine is taken from the runner's prompt processing.
@functools.cache
def _upsert_statement(dialect: str, table: Table) -> Any:
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
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
        for r in result.mappings():
            state.put(row_type(**r))
    return state


async def load_live_state(conn: AsyncConnection) -> ClusterState:
    """What the projector keeps in memory (``residency.py``): every table but the history,
    ended tasks and stored responses."""
    state = await load_state(conn, [n for n in STATE_TABLES if n not in _HISTORY])
    result = await conn.execute(select(tasks).where(tasks.c.status.not_in(TASK_ENDED)))
    for r in result.mappings():
        state.put(TaskRow(**r))
    return state


_HISTORY = (TaskRow.TABLE, ResponseRow.TABLE)


async def read_rows(
    conn: AsyncConnection, table_name: str, keys: Iterable[tuple[Any, ...]]
) -> list[Row]:
    """The rows of ``table_name`` with these primary keys (those that exist)."""
    table = STATE_TABLES[table_name]
    row_type = ROW_TYPE_BY_TABLE[table_name]
    pk = tuple(table.primary_key.columns)
    rows: list[Row] = []
    for chunk in key_chunks(list(keys)):
        query = select(table).where(tuple_(*pk).in_(chunk))
        rows += [row_type(**r) for r in (await conn.execute(query)).mappings()]
    return rows


# Keys a statement names at most.
KEY_CHUNK = 512


def key_chunks(keys: list[K]) -> Iterator[list[K]]:
    """``keys`` in lists of at most ``KEY_CHUNK``, each padded to a power of two by repeating
    its last key (``IN`` ignores the repeats). A statement thus takes at most ten shapes
    whatever the number of keys: SQLite and asyncpg keep every statement they prepared in a
    per-connection cache, and the projector's, one statement per list length, held megabytes
    (bench/soak.py)."""
    for i in range(0, len(keys), KEY_CHUNK):
        chunk = keys[i : i + KEY_CHUNK]
        padded = 1 << (len(chunk) - 1).bit_length()
        yield chunk + [chunk[-1]] * (padded - len(chunk))


async def unfinished_tasks(conn: AsyncConnection, runner_ids: Iterable[str]) -> list[TaskRow]:
    """The tasks started by these runners that have not ended."""
    ids = list(runner_ids)
    if not ids:
        return []
    result = await conn.execute(
        select(tasks).where(tasks.c.runner_id.in_(ids), tasks.c.status.not_in(TASK_ENDED))
    )
    return [TaskRow(**r) for r in result.mappings()]


async def unfinished_by_model(conn: AsyncConnection) -> dict[tuple[str, str], int]:
    """Tasks not ended, by model and kind ('chat', 'completion', 'embedding')."""
    query = (
        select(tasks.c.model_id, tasks.c.kind, func.count())
        .where(tasks.c.status.not_in(TASK_ENDED))
        .group_by(tasks.c.model_id, tasks.c.kind)
    )
    return {(m, k): n for m, k, n in (await conn.execute(query)).all()}


async def task_resumes(conn: AsyncConnection) -> int:
    """Tasks' continuations after a lost runner, all tasks together."""
    return int(await conn.scalar(select(func.coalesce(func.sum(tasks.c.resumes), 0))) or 0)


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
        for chunk in key_chunks(keys):
            await conn.execute(delete(table).where(tuple_(*pk).in_(chunk)))
    for name, values in puts.items():
        await conn.execute(_upsert(conn, STATE_TABLES[name]), values)
    return sum(len(v) for v in puts.values()) + sum(len(k) for k in deletes.values())


async def read_offset(conn: AsyncConnection, projector: str, stream: str) -> int:
    t = projector_offsets
    q = select(t.c.last_seq).where(t.c.projector == projector, t.c.stream == stream)
    seq = (await conn.execute(q)).scalar_one_or_none()
    return int(seq) if seq is not None else 0


async def read_tracking(conn: AsyncConnection, projector: str, stream: str) -> tuple[int, str]:
    """The tracking row: the last sequence applied and the digest of its message ("" when
    unknown); (0, "") when there is none."""
    t = projector_offsets
    q = select(t.c.last_seq, t.c.last_digest).where(
        t.c.projector == projector, t.c.stream == stream
    )
    row = (await conn.execute(q)).one_or_none()
    return (int(row[0]), str(row[1])) if row is not None else (0, "")


class OffsetConflict(RuntimeError):
    """The tracking row is not where this writer last saw it: another projector writes to the
    same database under the same name. Not retried: the writer stops."""


async def write_offset(
    conn: AsyncConnection,
    projector: str,
    stream: str,
    seq: int,
    expected: int,
    digest: str = "",
) -> None:
    """Move the tracking row from ``expected`` (0: there is none yet) to ``seq``, whose
    message's digest is ``digest`` (``bus/log_position.py``), as a compare-and-set: were it
    moved by another writer meanwhile, ``OffsetConflict``, and the transaction must not
    commit."""
    t = projector_offsets
    if expected == 0:
        values = {"projector": projector, "stream": stream, "last_seq": seq, "last_digest": digest}
        insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        stmt: Any = insert(t).values(values).on_conflict_do_nothing()
    else:
        stmt = (
            update(t)
            .where(t.c.projector == projector, t.c.stream == stream, t.c.last_seq == expected)
            .values(last_seq=seq, last_digest=digest)
        )
    if (await conn.execute(stmt)).rowcount != 1:
        found = await read_offset(conn, projector, stream)
        raise OffsetConflict(
            f"projector {projector!r}: the tracking row of {stream} is at {found}, not at"
            f" {expected} where this projector left it: another projector of that name writes"
            " to this database"
        )


async def read_counts(conn: AsyncConnection, projector: str, stream: str) -> dict[str, int]:
    """The events of each type a projector has counted in ``stream``."""
    t = event_counts
    q = select(t.c.type, t.c.events).where(t.c.projector == projector, t.c.stream == stream)
    return {str(kind): int(n) for kind, n in await conn.execute(q)}


async def write_counts(
    conn: AsyncConnection, projector: str, stream: str, counts: Mapping[str, int]
) -> None:
    """Set these types' counts (the projector's whole tallies, not increments)."""
    if counts:
        rows = [
            {"projector": projector, "stream": stream, "type": kind, "events": n}
            for kind, n in counts.items()
        ]
        await conn.execute(_upsert(conn, event_counts), rows)


@dataclass(frozen=True)
class Progress:
    """Where a projector stands in a stream, and what it has counted there by type."""

    last_seq: int
    events_by_type: dict[str, int]


async def read_progress(conn: AsyncConnection, stream: str) -> dict[str, Progress]:
    """Every projector's progress in ``stream``. One statement, so that the tracking rows and
    the counts are of the same commit (PostgreSQL gives each statement its own snapshot)."""
    o, c = projector_offsets, event_counts
    q = union_all(
        select(o.c.projector, null().label("type"), o.c.last_seq.label("n")).where(
            o.c.stream == stream
        ),
        select(c.c.projector, c.c.type, c.c.events).where(c.c.stream == stream),
    )
    seqs: dict[str, int] = {}
    counts: dict[str, dict[str, int]] = {}
    for name, kind, n in await conn.execute(q):
        if kind is None:
            seqs[str(name)] = int(n)
        else:
            counts.setdefault(str(name), {})[str(kind)] = int(n)
    return {
        name: Progress(seqs.get(name, 0), counts.get(name, {})) for name in seqs.keys() | counts
    }


async def table_rows(conn: AsyncConnection, name: str) -> list[dict[str, Any]]:
    """Every row of a state table in key order: for comparing projections and `shoal state`."""
    table = STATE_TABLES[name]
    result = await conn.execute(select(table).order_by(*table.primary_key.columns))
    return [dict(r) for r in result.mappings()]
