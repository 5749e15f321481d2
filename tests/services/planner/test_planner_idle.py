"""An idle planner looks at the cluster now and then, not in a loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import Publisher
from events.catalogue import InstanceRequested, NodeJoined, ResourceProfiled
from events.records import NodeProfile
from events.units import GiB
from projectors import database
from projectors.projector import Projector
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

    async def rounds_reach(n: int) -> float:
        while planner.stats.rounds < n:
            await asyncio.sleep(0.01)
        return time.monotonic()

    # Timed from the end of the first round (its start may be slow on a loaded machine): three
    # more rounds take at least three max_idle_s; going round every 20 ms took 60 ms.
    first = await asyncio.wait_for(rounds_reach(1), 30)
    fourth = await asyncio.wait_for(rounds_reach(4), 30)
    stop.set()
    await asyncio.wait_for(running, 10)
    assert fourth - first >= 3 * 0.4 * 0.9


@pytest.mark.parametrize("idle_s", [60.0, 0.5])
async def test_heartbeats_wake_a_round_only_when_they_can_change_a_decision(
    nc: Client, js: JetStreamContext, engine: AsyncEngine, idle_s: float
) -> None:
    """A heartbeat of a node known online changes nothing while no instance waits for a place:
    it used to wake a round each time (every 2 s per node, ~20 ms of CPU). Once an instance
    waits (here: rejected, its model unknown), each heartbeat is looked at again. The idle
    rounds (every ``idle_s``) load the heartbeats skipped since the last one, and that used to
    wake a second round at once."""
    stop = asyncio.Event()
    projector = Projector(js, engine)
    tasks = [asyncio.create_task(projector.run(stop))]
    await asyncio.wait_for(projector.ready.wait(), 30)
    pub = Publisher(js)
    profile = NodeProfile(ram_total=2 * GiB, ram_available=GiB, cpu_count=2, memory_offered=GiB)

    async def heartbeats(n: int) -> int:
        before = planner.stats.rounds
        for _ in range(n):
            await pub.publish(ResourceProfiled(node_id="n", origin="n", profile=profile))
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        return planner.stats.rounds - before

    await pub.publish(NodeJoined(node_id="n", origin="n", heartbeat_s=3600))
    await pub.publish(ResourceProfiled(node_id="n", origin="n", profile=profile))
    planner = Planner(nc, engine, min_round_s=0.02, max_idle_s=idle_s)
    tasks.append(asyncio.create_task(planner.run(stop)))
    try:
        async with asyncio.timeout(30):
            while planner.stats.rounds == 0:
                await asyncio.sleep(0.05)
        rounds = await heartbeats(10)  # over 1.3 s
        # None, or the idle rounds only (2-3; each waking a second at once made 5 or more).
        assert rounds == 0 if idle_s > 10 else rounds <= 4

        await pub.publish(InstanceRequested(instance_id="i", model_id="unknown", origin="t"))
        async with asyncio.timeout(30):
            while planner.stats.by_type.get("PlacementRejected", 0) == 0:
                await asyncio.sleep(0.05)
        assert await heartbeats(5) >= 3
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
