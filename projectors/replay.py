"""``shoal replay``: rebuild a fresh projection from the log, up to a sequence or a time.

It uses the same rules and the same writer as the live projector, so a replay to the live
projector's sequence produces exactly its rows, and the same counts of events by type. The
tracking row is written too, so the rebuilt database can be handed to a live projector, which
then carries on from there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.consumer import describe_invalid, stream_seq
from bus.log_position import digest
from bus.reader import read_stream
from bus.streams import EVENTS_STREAM
from events.catalogue import Event, parse_event, subject_event_type
from events.subjects import ALL_EVENTS
from projectors import database, snapshot
from projectors.projector import DEFAULT_NAME
from projectors.residency import read_history
from projectors.rules import changes_for
from projectors.state import Change
from projectors.store import (
    check_storable,
    load_live_state,
    read_counts,
    write_changes,
    write_counts,
    write_offset,
)
from projectors.tables import STATE_TABLES, event_counts, projector_offsets

log = logging.getLogger(__name__)

# Events read before they are folded: the history rows they name are read from the database
# in one go.
READ_AHEAD = 2000


class ReplayError(RuntimeError):
    pass


@dataclass(frozen=True)
class ReplayResult:
    applied: int
    skipped: int
    last_seq: int


async def _ensure_empty(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        for table in (*STATE_TABLES.values(), projector_offsets, event_counts):
            n = (await conn.execute(select(func.count()).select_from(table))).scalar_one()
            if n:
                raise ReplayError(
                    f"the target database is not empty (table {table.name} has {n} rows); "
                    "replay builds a fresh projection: give it a new database"
                )


async def replay(
    js: JetStreamContext,
    engine: AsyncEngine,
    *,
    until_seq: int | None = None,
    until_time: datetime | None = None,
    name: str = DEFAULT_NAME,
    commit_every: int = 50_000,
    from_snapshot: bool = True,
) -> ReplayResult:
    """Fold the event stream into the empty database at ``engine``: from the newest snapshot
    at or before where it stops (``from_snapshot``; needed once old events aged out), else
    from its first message. Stops after ``until_seq``, before the first event stored after
    ``until_time``, or at the stream's last message when replay started. Events the live
    projector sets aside (malformed, whose rule fails, or whose rows cannot be stored) are
    skipped here too."""
    await database.upgrade(engine)
    await _ensure_empty(engine)
    start = await _starting_snapshot(js, name, until_seq, from_snapshot)
    committed = 0
    if start is not None:
        committed = await snapshot.restore(engine, js, start)
    async with engine.connect() as conn:
        state = await load_live_state(conn)
        counts = await read_counts(conn, name, EVENTS_STREAM)
    if until_time is not None and committed and await _stored_at(js, committed + 1) > until_time:
        raise ReplayError(
            f"the snapshot at seq {committed}, the oldest usable, is later than {until_time}"
        )
    pending: list[Change] = []
    applied = skipped = 0
    last_seq = committed
    # Events read, not yet folded: sequence, type by subject, event (None: malformed).
    read: list[tuple[int, str | None, Event | None]] = []
    last_data = b""  # the last message read: its digest goes in the tracking row

    async def fold_read() -> None:
        nonlocal applied, skipped, committed, pending
        # What memory does not hold (``residency.py``), read once for the lot.
        await read_history(engine, state, [e for _, _, e in read if e is not None])
        for seq, kind, event in read:
            # Counted by subject, malformed ones too, as the projector counts them.
            if kind is not None:
                counts[kind] = counts.get(kind, 0) + 1
            if event is None:
                skipped += 1
                continue
            try:
                ch = changes_for(state, event)
                check_storable(ch)
            except Exception as exc:  # rule error or unstorable: the projector dead-letters these
                log.warning("replay skips seq %d: %r", seq, exc)
                skipped += 1
                continue
            state.commit(ch)
            pending.extend(ch)
            applied += 1
        if read and len(pending) >= commit_every:
            committed = await _commit(
                engine, pending, counts, name, read[-1][0], committed, digest(last_data)
            )
            pending = []
            state.forget_history()  # once written: the database has what memory lets go
        read.clear()

    async for msg in read_stream(
        js, EVENTS_STREAM, ALL_EVENTS, from_seq=committed + 1, to_seq=until_seq
    ):
        if until_time is not None and msg.metadata.timestamp > until_time:
            break
        last_seq, last_data = stream_seq(msg), msg.data
        kind = subject_event_type(msg.subject)
        try:
            read.append((last_seq, kind, parse_event(msg.data)))
        except ValidationError as exc:
            log.warning("replay skips seq %d: %s", last_seq, describe_invalid(exc))
            read.append((last_seq, kind, None))
        if len(read) >= READ_AHEAD:
            await fold_read()
    await fold_read()
    await _commit(engine, pending, counts, name, last_seq, committed, digest(last_data))
    return ReplayResult(applied=applied, skipped=skipped, last_seq=last_seq)


async def _starting_snapshot(
    js: JetStreamContext, name: str, until_seq: int | None, wanted: bool
) -> snapshot.Snapshot | None:
    """The snapshot a replay to ``until_seq`` starts from: the newest at or before it whose
    following events are all still in the log; None to start from the first event. A replay
    that the log and the snapshots cannot make is a ReplayError naming the oldest event kept."""
    log_state = (await js.stream_info(EVENTS_STREAM)).state
    first = log_state.first_seq
    if until_seq is not None and first > 1 and until_seq < first - 1:
        raise ReplayError(
            f"seq {until_seq} is older than the log's oldest kept event, #{first}"
            " (older ones aged out): replay to a later sequence"
        )
    if not wanted:
        if first > 1:
            raise ReplayError(
                f"the log's oldest kept event is #{first} (older ones aged out): it cannot be"
                " rebuilt from its first event; replay from a snapshot"
            )
        return None
    listed = [s for s in await snapshot.listed(js, name) if s.seq >= first - 1]
    usable = await snapshot.of_this_log(js, listed, log_state.last_seq)
    found = snapshot.chosen(usable, until_seq)
    if found is None and first > 1:
        raise ReplayError(
            f"the log's oldest kept event is #{first} and no snapshot of projector {name!r}"
            f" at or after #{first - 1} is at or before seq {until_seq}: it cannot be rebuilt"
        )
    return found


async def _stored_at(js: JetStreamContext, seq: int) -> datetime:
    """When event ``seq`` was stored (the end of time when there is none yet)."""
    try:
        msg = await js.get_msg(EVENTS_STREAM, seq)
    except NotFoundError:
        return datetime.max.replace(tzinfo=UTC)
    return msg.time or datetime.max.replace(tzinfo=UTC)


async def _commit(
    engine: AsyncEngine,
    changes: list[Change],
    counts: dict[str, int],
    name: str,
    last_seq: int,
    committed: int,
    last_digest: str,
) -> int:
    """Write ``changes``, the counts and the tracking row (moved from ``committed``, the last
    commit's sequence); returns the sequence committed."""
    async with engine.begin() as conn:
        await write_changes(conn, changes)
        await write_counts(conn, name, EVENTS_STREAM, counts)
        if last_seq > committed:
            await write_offset(conn, name, EVENTS_STREAM, last_seq, committed, last_digest)
    return last_seq
