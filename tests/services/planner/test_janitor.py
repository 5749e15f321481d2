"""Stored responses past their expiry are deleted on the log, and old ended tasks forgotten,
once, by any planner (services/planner/janitor.py), against a real nats-server and database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import Publisher
from events.catalogue import (
    EventBase,
    ResponseDeleted,
    ResponseStored,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
)
from services.planner.janitor import delete_expired, forget_ended
from tests.projectors.helpers import db_rows, running_projector, wait_for_seq
from tests.services.event_log import EventLog


async def test_expired_responses_are_deleted_once(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    now = datetime.now(UTC)
    pub = Publisher(js)
    for response_id, expires in (("old", now - timedelta(days=1)), ("new", now + timedelta(1))):
        await pub.publish(ResponseStored(response_id=response_id, origin="api", expires_at=expires))
    await pub.publish(ResponseStored(response_id="kept", origin="api"))  # stored before expiry
    log = await EventLog().start(js)
    try:
        async with running_projector(js, engine) as projector:
            await wait_for_seq(projector, 3)
            # Two planners, or one round after another: one deletion.
            assert await delete_expired(pub, engine, now, "planner-a") == 1
            assert await delete_expired(pub, engine, now, "planner-b") == 1
            deleted = await log.wait_for(ResponseDeleted)
            await wait_for_seq(projector, 4)
            assert await delete_expired(pub, engine, now, "planner-a") == 0
        assert (deleted.response_id, deleted.reason) == ("old", "expired")
        assert len(log.of(ResponseDeleted)) == 1
        rows = {r["response_id"]: r for r in (await db_rows(engine))["responses"]}
        assert rows["old"]["status"] == "deleted" and rows["new"]["status"] == "completed"
        assert rows["kept"]["expires_at"] is None
    finally:
        await log.stop()


async def test_tasks_ended_before_the_logs_age_limit_are_forgotten_once(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """Tasks that ended more than ``keep_s`` ago leave the projection, oldest first and page by
    page; a task still running, or ended since, stays; with no age limit nothing leaves."""
    now = datetime.now(UTC)
    pub = Publisher(js)

    def ended(task_id: str, days_ago: float) -> list[EventBase]:
        at = now - timedelta(days=days_ago)
        created = TaskCreated(task_id=task_id, model_id="m", origin="api", ts=at)
        return [created, TaskFailed(task_id=task_id, model_id="m", origin="n", ts=at, error="x")]

    history = [e for i in range(5) for e in ended(f"old{i}", 40 - i)]
    history += [*ended("recent", 1), TaskCreated(task_id="open", model_id="m", origin="api")]
    for e in history:
        await pub.publish(e)
    log = await EventLog().start(js)
    try:
        async with running_projector(js, engine) as projector:
            await wait_for_seq(projector, len(history))
            assert await forget_ended(pub, engine, now, "planner-a", 0) == 0
            month = 30 * 86400.0
            # Pages of 2: three of them.
            assert await forget_ended(pub, engine, now, "planner-a", month, page_size=2) == 5
            assert await forget_ended(pub, engine, now, "planner-b", month, page_size=2) == 5
            await wait_for_seq(projector, len(history) + 5)
            assert await forget_ended(pub, engine, now, "planner-a", month) == 0
        forgotten = [e.task_id for e in log.of(TaskForgotten)]
        assert forgotten == [f"old{i}" for i in range(5)]  # once each, oldest first
        rows = {r["task_id"] for r in (await db_rows(engine))["tasks"]}
        assert rows == {"recent", "open"}
    finally:
        await log.stop()
