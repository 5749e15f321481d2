"""A planner that starts before the projector has migrated the database waits for it."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine

from projectors import database
from services.planner.planner import Planner


async def test_a_half_migrated_projection_is_waited_for_not_an_error(
    nc: Client, engine: AsyncEngine
) -> None:
    """Migration 0001 is there (with the projector's offset table), 0002 not yet: the planning
    tables lack columns. The planner's round waits, and reads them once the schema is whole."""
    await database.upgrade(engine, "0001")
    planner = Planner(nc, engine)
    reading = asyncio.create_task(planner.round())
    await asyncio.sleep(0.5)
    assert not reading.done()  # waiting, not failed
    await database.upgrade(engine)
    assert await asyncio.wait_for(reading, 10) == []  # an empty cluster: nothing to decide
