"""Stored responses past their expiry are deleted on the log, once, by any planner
(services/planner/janitor.py), against a real nats-server and database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.events import ResponseDeleted, ResponseStored
from bus.publisher import Publisher
from services.planner.janitor import delete_expired
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
