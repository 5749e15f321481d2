"""The planner's housekeeping, done on the log so that the projection and a replay agree.

- Stored responses past their expiry are deleted. A response's expiry is in its
  ``ResponseStored`` (``expires_at``, set by the API from its ``response_ttl_s``); the API
  already answers 404 for one past it, and this makes it so for the projection: a
  ``ResponseDeleted`` with reason "expired" and the message id ``expired:<id>``.
- Ended tasks are forgotten once they ended longer ago than the events stream keeps events (its
  ``max_age``; none while it keeps them forever): a ``TaskForgotten`` with the message id
  ``forgotten:<id>``, and the projection deletes the task's row. Without it the tasks table,
  and every snapshot of the projection, would grow with every request for as long as the
  cluster runs.

The message ids are deterministic, so that any number of planners do each once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from sqlalchemy import select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM
from events.catalogue import ResponseDeleted, TaskForgotten
from events.states import TASK_ENDED
from projectors.tables import responses, tasks

log = logging.getLogger(__name__)

# How often expired responses are looked for, and how many are deleted a round at most.
EVERY_S = 60.0
BATCH = 500
# Ended tasks forgotten a round at most: pages of BATCH.
FORGET_PAGES = 20


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


async def forget_ended(
    pub: Publisher,
    engine: AsyncEngine,
    now: datetime,
    origin: str,
    keep_s: float,
    page_size: int = BATCH,
) -> int:
    """Forget on the log the tasks that ended more than ``keep_s`` seconds before ``now``
    (0: none), oldest first, at most ``FORGET_PAGES`` pages of ``page_size``; returns how
    many."""
    if keep_s <= 0:
        return 0
    ended_before = tasks.c.finished_at <= now - timedelta(seconds=keep_s)
    order = (tasks.c.finished_at, tasks.c.task_id)
    after: tuple[datetime, str] | None = None
    forgotten = 0
    for _ in range(FORGET_PAGES):
        query = select(tasks.c.task_id, tasks.c.model_id, tasks.c.finished_at).where(
            ended_before, tasks.c.status.in_(TASK_ENDED)
        )
        if after is not None:  # past the page before: its events may not be projected yet
            query = query.where(tuple_(*order) > after)
        async with engine.connect() as conn:
            page = (await conn.execute(query.order_by(*order).limit(page_size))).all()
        for task_id, model_id, _ in page:
            event = TaskForgotten(task_id=task_id, model_id=model_id, origin=origin)
            await pub.publish(event, msg_id=f"forgotten:{task_id}")
        forgotten += len(page)
        if len(page) < page_size:
            break
        after = (page[-1].finished_at, page[-1].task_id)
    if forgotten:
        log.info("forgot %d tasks that ended more than %.0f s ago", forgotten, keep_s)
    return forgotten


async def events_max_age(js: JetStreamContext) -> float:
    """How long the events stream keeps an event, in seconds (0: forever)."""
    return float((await js.stream_info(EVENTS_STREAM)).config.max_age or 0.0)


async def keep_tidy(
    js: JetStreamContext,
    pub: Publisher,
    engine: AsyncEngine,
    origin: str,
    stop: asyncio.Event,
    every_s: float = EVERY_S,
) -> None:
    """Delete expired responses and forget old ended tasks every ``every_s`` until ``stop``."""
    while not stop.is_set():
        now = datetime.now(UTC)
        try:
            await delete_expired(pub, engine, now, origin)
        except Exception:  # the next round tries again
            log.exception("deleting expired responses failed")
        try:
            await forget_ended(pub, engine, now, origin, await events_max_age(js))
        except Exception:
            log.exception("forgetting ended tasks failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
