"""The planner's housekeeping: stored responses past their expiry are deleted on the log.

A response's expiry is in its ``ResponseStored`` (``expires_at``, set by the API from its
``response_ttl_s``); the API already answers 404 for one past it, and this makes it so for the
projection, replay included: a ``ResponseDeleted`` with reason "expired" and the deterministic
message id ``expired:<id>``, so that any number of planners delete it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.events import ResponseDeleted
from bus.publisher import Publisher
from projectors.tables import responses

log = logging.getLogger(__name__)

# How often expired responses are looked for, and how many are deleted a round at most.
EVERY_S = 60.0
BATCH = 500


async def delete_expired(pub: Publisher, engine: AsyncEngine, now: datetime, origin: str) -> int:
    """Delete on the log the stored responses expired at ``now``; returns how many."""
    query = (
        select(responses.c.response_id)
        .where(responses.c.expires_at <= now, responses.c.deleted_at.is_(None))
        .order_by(responses.c.expires_at)
        .limit(BATCH)
    )
    async with engine.connect() as conn:
        ids = [str(r) for r in (await conn.execute(query)).scalars()]
    for response_id in ids:
        event = ResponseDeleted(response_id=response_id, origin=origin, reason="expired")
        await pub.publish(event, msg_id=f"expired:{response_id}")
    if ids:
        log.info("deleted %d expired stored responses", len(ids))
    return len(ids)


async def keep_tidy(
    pub: Publisher, engine: AsyncEngine, origin: str, stop: asyncio.Event, every_s: float = EVERY_S
) -> None:
    """Delete expired responses every ``every_s`` until ``stop``."""
    while not stop.is_set():
        try:
            await delete_expired(pub, engine, datetime.now(UTC), origin)
        except Exception:  # the next round tries again
            log.exception("deleting expired responses failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
