"""Snapshots of the projection, so that the log need not be kept forever.

A snapshot is the whole projection at one sequence of the events stream: every row of every
state table, the projector's tracking row and its counts by type, as gzipped JSON lines in the
``SHOAL_SNAPSHOTS`` object store bucket, named ``<projector>/<seq>`` and tagged with the schema
revision that wrote it. A projector writes one every so often; a projector with an empty
database, or one so far behind that the events it needs are gone, starts from the newest, and
``shoal replay`` from the newest at or before the sequence asked. Events older than the oldest
snapshot can then age out (``shoal up --retain``).

An object's meta is stored after its chunks (``bus/stores/object_store.py``): a snapshot whose
writer was killed half way is not listed, and the one before it stays the newest.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo
from nats.js.errors import NotFoundError
from sqlalchemy import Table, delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from bus.log_position import check_position, digest
from bus.stores.object_fetch import fetch_file
from bus.stores.object_store import (
    meta_subject,
    object_chunks_subject,
    object_info,
    object_stream,
    put_file,
)
from bus.streams import EVENTS_STREAM, SNAPSHOTS_BUCKET
from projectors import database
from projectors.store import read_tracking
from projectors.tables import STATE_TABLES, UtcDateTime, event_counts, projector_offsets

log = logging.getLogger(__name__)

FORMAT = 1
# Rows read from the database at a time while a snapshot is written. Small: the rows in hand
# (and their JSON) are the writer's peak memory, which a live projector's heap keeps after it.
PAGE = 200
# Rows inserted at a time while one is restored (at a start, before any live work).
INSERT_PAGE = 2000
# Snapshots a projector keeps: the newest and the ones before it.
KEEP = 3


class SnapshotError(RuntimeError):
    pass


@dataclass(frozen=True)
class Snapshot:
    """A stored snapshot: whose, at which sequence, written by which schema revision."""

    projector: str
    seq: int
    revision: str
    size: int
    digest: str = ""  # of the event at seq (bus/log_position.py); "" in older snapshots

    @property
    def name(self) -> str:
        return snapshot_name(self.projector, self.seq)


def snapshot_name(projector: str, seq: int) -> str:
    return f"{projector}/{seq:012d}"


def _tables() -> list[Table]:
    return [*STATE_TABLES.values(), projector_offsets, event_counts]


_TIMES = {t.name: {c.name for c in t.columns if isinstance(c.type, UtcDateTime)} for t in _tables()}


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _row_of(table: str, values: dict[str, Any]) -> dict[str, Any]:
    times = _TIMES[table]
    return {
        k: datetime.fromisoformat(v) if k in times and isinstance(v, str) else v
        for k, v in values.items()
    }


# --- writing ------------------------------------------------------------------------------


async def dump(conn: AsyncConnection, projector: str, out: IO[bytes]) -> tuple[int, str]:
    """Write the projection as seen by ``conn`` (no writer in between: the projector writes
    one between batches) to ``out``, gzipped; returns its sequence and that event's digest."""
    seq, digest = await read_tracking(conn, projector, EVENTS_STREAM)
    revision = await conn.run_sync(database.revision_of)
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=3) as z:
        head = {"format": FORMAT, "projector": projector, "seq": seq, "revision": revision}
        z.write(json.dumps(head).encode() + b"\n")
        for table in _tables():
            query = select(table).order_by(*table.primary_key.columns)
            if table in (projector_offsets, event_counts):
                query = query.where(table.c.projector == projector)
            result = await conn.stream(query.execution_options(yield_per=PAGE))
            async for part in result.mappings().partitions(PAGE):
                lines = (
                    json.dumps({"t": table.name, "r": {k: _jsonable(v) for k, v in r.items()}})
                    for r in part
                )
                z.write(("\n".join(lines) + "\n").encode())
    return seq, digest


async def write(
    engine: AsyncEngine,
    js: JetStreamContext,
    projector: str,
    *,
    keep: int = KEEP,
    on_progress: Callable[[int], None] | None = None,
) -> Snapshot:
    """Take a snapshot of the projection and store it; the oldest beyond ``keep`` go."""
    with tempfile.NamedTemporaryFile(prefix="shoal-snapshot-", suffix=".jsonl.gz") as f:
        async with engine.connect() as conn:
            seq, digest = await dump(conn, projector, f)
            revision = await conn.run_sync(database.revision_of)
        f.flush()
        size = f.tell()
        name = snapshot_name(projector, seq)
        await put_file(
            js,
            SNAPSHOTS_BUCKET,
            name,
            Path(f.name),
            description=f"the projection {projector!r} at seq {seq}",
            headers={
                "Shoal-Seq": str(seq),
                "Shoal-Revision": revision or "",
                "Shoal-Digest": digest,
            },
            on_progress=on_progress,
        )
    made = Snapshot(projector, seq, revision or "", size, digest)
    for old in (await listed(js, projector))[:-keep]:
        await remove(js, old)
    log.info("snapshot %s written: %d bytes", name, size)
    return made


# --- listing ------------------------------------------------------------------------------


def _snapshot_of(info: ObjectInfo) -> Snapshot | None:
    headers = info.headers or {}
    projector, _, seq = info.name.rpartition("/")
    if not projector or not seq.isdigit():
        return None
    return Snapshot(
        projector,
        int(seq),
        str(headers.get("Shoal-Revision", "")),
        info.size or 0,
        str(headers.get("Shoal-Digest", "")),
    )


async def listed(js: JetStreamContext, projector: str) -> list[Snapshot]:
    """The projector's snapshots, oldest first (only whole ones: a meta is stored last)."""
    prefix = f"$O.{SNAPSHOTS_BUCKET}.M."
    try:
        info = await js.stream_info(object_stream(SNAPSHOTS_BUCKET), subjects_filter=f"{prefix}>")
    except NotFoundError:
        return []
    found: list[Snapshot] = []
    for subject in info.state.subjects or {}:
        name = base64.urlsafe_b64decode(subject.removeprefix(prefix)).decode()
        meta = await object_info(js, SNAPSHOTS_BUCKET, name)
        if meta is not None and (s := _snapshot_of(meta)) is not None and s.projector == projector:
            found.append(s)
    return sorted(found, key=lambda s: s.seq)


async def digest_at(js: JetStreamContext, seq: int) -> str | None:
    """The digest of the events stream's message at ``seq``; None when it has none."""
    try:
        msg = await js.get_msg(EVENTS_STREAM, seq)
    except NotFoundError:
        return None
    return digest(msg.data or b"")


async def of_this_log(
    js: JetStreamContext, snapshots: list[Snapshot], last_seq: int
) -> list[Snapshot]:
    """The snapshots whose event the log still holds at their sequence: not those of a tail
    the log lost (``bus/log_position.py``)."""
    usable = []
    for s in snapshots:
        at = await digest_at(js, s.seq) if 0 < s.seq <= last_seq else None
        if not check_position(s.seq, s.digest, last_seq, at).lost:
            usable.append(s)
    return usable


def chosen(snapshots: list[Snapshot], at_or_before: int | None) -> Snapshot | None:
    """The newest snapshot at or before a sequence (any, with None)."""
    fit = [s for s in snapshots if at_or_before is None or s.seq <= at_or_before]
    return max(fit, key=lambda s: s.seq) if fit else None


async def remove(js: JetStreamContext, snapshot: Snapshot) -> None:
    meta = await object_info(js, SNAPSHOTS_BUCKET, snapshot.name)
    stream = object_stream(SNAPSHOTS_BUCKET)
    await js.purge_stream(stream, subject=meta_subject(SNAPSHOTS_BUCKET, snapshot.name))
    if meta is not None and meta.nuid:
        await js.purge_stream(stream, subject=object_chunks_subject(SNAPSHOTS_BUCKET, meta.nuid))


async def _empty(conn: AsyncConnection) -> None:
    for table in _tables():
        await conn.execute(delete(table))


async def clear(engine: AsyncEngine) -> None:
    """Empty the projection, tracking rows and counts included: what a rebuild from the log
    alone starts from."""
    async with engine.begin() as conn:
        await _empty(conn)


# --- reading ------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rb") as z:
        for line in z:
            if line.strip():
                yield json.loads(line)


async def restore(engine: AsyncEngine, js: JetStreamContext, snapshot: Snapshot) -> int:
    """Make the database at ``engine`` hold the snapshot: every table emptied, then filled, in
    one transaction; returns its sequence. Its columns are matched by name, so a snapshot of an
    older schema revision loads into a newer one (new columns take their defaults)."""
    meta = await object_info(js, SNAPSHOTS_BUCKET, snapshot.name)
    if meta is None:
        raise SnapshotError(f"snapshot {snapshot.name} is gone from {SNAPSHOTS_BUCKET}")
    await database.upgrade(engine)
    with tempfile.TemporaryDirectory(prefix="shoal-snapshot-") as tmp:
        path = await fetch_file(js, SNAPSHOTS_BUCKET, meta, Path(tmp) / "snapshot.jsonl.gz")
        lines = _lines(path)
        head = next(lines)
        if head.get("format") != FORMAT:
            raise SnapshotError(f"snapshot {snapshot.name} is of format {head.get('format')}")
        tables = {t.name: t for t in _tables()}
        async with engine.begin() as conn:
            await _empty(conn)
            pending: dict[str, list[dict[str, Any]]] = {}
            for line in lines:
                table = tables[line["t"]]
                columns = {c.name for c in table.columns}
                row = _row_of(table.name, {k: v for k, v in line["r"].items() if k in columns})
                rows = pending.setdefault(table.name, [])
                rows.append(row)
                if len(rows) >= INSERT_PAGE:
                    await conn.execute(insert(table), rows)
                    rows.clear()
                    await asyncio.sleep(0)
            for name, rows in pending.items():
                if rows:
                    await conn.execute(insert(tables[name]), rows)
    log.info("projection restored from snapshot %s (seq %d)", snapshot.name, head["seq"])
    return int(head["seq"])
