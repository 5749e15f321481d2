"""Loading on demand outlives the processes around it: a cold model's instance is asked for
while the planner is held, then the planner is killed and another started, and one of the two
API processes whose requests wait for the model is killed. The instance is placed once, by the
new planner, from the log; the other API's waiting requests are answered."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from events.catalogue import InstancePlaced, InstanceRequested
from tests.faults.cluster import MODEL, running_cluster
from tests.faults.invariants import check_answered, load, read_log_once_ended

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_a_cold_model_loads_through_a_planner_restart_and_a_killed_api(
    tmp_path: Path,
) -> None:
    async with running_cluster(tmp_path) as c:
        await c.start_projector()
        c.start_planner("p1")
        await c.start_worker("w-a")
        await c.start_api("api-1")
        await c.start_api("api-2")
        await c.add_model()

        # No instance serves the model: the requests ask for one, and wait for it while the
        # planner is held.
        held = c.procs.procs["p1"]
        os.kill(held.pid, signal.SIGSTOP)
        waiting = asyncio.create_task(
            load(["api-1", "api-2"], c.apis, 6, label="cold", deadline_s=180)
        )
        asked = await c.log.wait_for(InstanceRequested, lambda e: e.model_id == MODEL)
        assert asked.on_demand
        c.kill("api-1")  # its waiting requests are cut; api-2's go on waiting
        c.kill("p1")  # a planner lost before it decided
        c.start_planner("p2")
        outcomes = await waiting

        print(*outcomes, sep="\n")
        check_answered([o for o in outcomes if o.api == "api-2"])
        assert {o.kind for o in outcomes if o.api == "api-1"} == {"cut"}
        await c.stop_all_but_projector()
        log = await read_log_once_ended(c.js)
        requested = [e for e in log.of(InstanceRequested) if e.model_id == MODEL]
        assert [e.instance_id for e in requested] == [asked.instance_id]  # asked for once
        placed = [e for e in log.of(InstancePlaced) if e.instance_id == asked.instance_id]
        assert len(placed) == 1, placed
