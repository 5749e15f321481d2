"""An idle planner looks at the cluster now and then, not in a loop."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine

from projectors import database
from services.planner.planner import Planner


async def test_an_idle_planner_goes_round_only_every_max_idle_s(
    nc: Client, engine: AsyncEngine
) -> None:
    """Nothing happens in the log: after its first round the planner waits max_idle_s between
    rounds. Its own look at the log (finding nothing new) once woke it again at once, and an
    idle planner went round every min_round_s, ten times a second."""
    await database.upgrade(engine)
    planner = Planner(nc, engine, min_round_s=0.02, max_idle_s=0.4)
    stop = asyncio.Event()
    running = asyncio.create_task(planner.run(stop))
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.wait_for(running, 10)
    # 1 at the start, then one every 0.4 s; going round every 20 ms would have made ~100.
    assert 3 <= planner.stats.rounds <= 7
