"""``shoal replay``: rebuild a fresh projection from the log, up to a sequence or a time.

It uses the same rules and the same writer as the live projector, so a replay to the live
projector's sequence produces exactly its rows. The tracking row is written too, so the rebuilt
database can be handed to a live projector, which then carries on from there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.consumer import describe_invalid
from bus.events import parse_event
from bus.streams import EVENTS_STREAM
from bus.subjects import EVENTS_PREFIX
from projectors import database
from projectors.projector import DEFAULT_NAME
from projectors.rules import changes_for
from projectors.state import Change, ClusterState
from projectors.store import write_changes, write_offset
from projectors.tables import STATE_TABLES, projector_offsets

log = logging.getLogger(__name__)


class ReplayError(RuntimeError):
    pass


@dataclass(frozen=True)
class ReplayResult:
    applied: int
    skipped_invalid: int
    last_seq: int


async def _ensure_empty(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        for table in (*STATE_TABLES.values(), projector_offsets):
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
    batch_size: int = 5000,
    commit_every: int = 50_000,
) -> ReplayResult:
    """Fold the event stream from its first message into the empty database at ``engine``.
    Stops after ``until_seq``, before the first event stored after ``until_time``, or at the
    stream's last message when replay started."""
    await database.upgrade(engine)
    await _ensure_empty(engine)
    info = await js.stream_info(EVENTS_STREAM)
    end_seq = info.state.last_seq if until_seq is None else min(until_seq, info.state.last_seq)
    state = ClusterState()
    pending: list[Change] = []
    applied = skipped = last_seq = 0
    if end_seq >= info.state.first_seq:
        # An ephemeral consumer without acks: replay reads, it does not take part in delivery.
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
            max_waiting=1,
        )
        sub = await js.pull_subscribe(f"{EVENTS_PREFIX}.>", stream=EVENTS_STREAM, config=config)
        try:
            while last_seq < end_seq:
                try:
                    msgs = await sub.fetch(batch_size, timeout=2.0)
                except NatsTimeoutError:
                    break  # nothing more (messages at the end may have aged out)
                for msg in msgs:
                    md = msg.metadata
                    seq = md.sequence.stream
                    if seq > end_seq or (until_time is not None and md.timestamp > until_time):
                        end_seq = last_seq
                        break
                    last_seq = seq
                    try:
                        event = parse_event(msg.data)
                    except ValidationError as exc:
                        log.warning("replay skips seq %d: %s", seq, describe_invalid(exc))
                        skipped += 1
                        continue
                    try:
                        ch = changes_for(state, event)
                    except Exception as exc:  # the live projector dead-letters these too
                        log.warning("replay skips seq %d: rule error %r", seq, exc)
                        skipped += 1
                        continue
                    state.commit(ch)
                    pending.extend(ch)
                    applied += 1
                if len(pending) >= commit_every:
                    await _commit(engine, pending, name, last_seq)
                    pending = []
        finally:
            await sub.unsubscribe()
    await _commit(engine, pending, name, last_seq)
    return ReplayResult(applied=applied, skipped_invalid=skipped, last_seq=last_seq)


async def _commit(engine: AsyncEngine, changes: list[Change], name: str, last_seq: int) -> None:
    async with engine.begin() as conn:
        await write_changes(conn, changes)
        if last_seq:
            await write_offset(conn, name, EVENTS_STREAM, last_seq)
