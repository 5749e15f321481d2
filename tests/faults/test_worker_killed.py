"""SIGKILL the worker that serves an instance, under load through the API: its node times out,
the instance is placed on the other worker and serves again; every request gets an answer.

tests/services/planner/test_failover.py shows the re-placement itself with three workers and
tasks published directly; this is the same fault seen by API clients, with the invariants."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.events import InstancePlaced, NodeTimedOut, TaskCompleted
from tests.faults.cluster import running_cluster
from tests.faults.invariants import (
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
    load,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_a_killed_worker_s_instance_serves_again_elsewhere(tmp_path: Path) -> None:
    async with running_cluster(tmp_path) as c:
        await c.start_projector()
        c.start_planner()
        # SmolLM2 needs about 200 MiB: w-a has the most room, so it gets the instance first.
        await c.start_worker("w-a", memory_limit="400M")
        await c.start_worker("w-b", memory_limit="330M")
        await c.start_api()
        await c.add_model()
        await c.request_instance("inst")
        first = await c.wait_serving("inst")
        assert first.node_id == "w-a"

        during = asyncio.create_task(load(["api"], c.apis, 8, label="during", concurrency=4,
                                          max_tokens=32, deadline_s=60))  # fmt: skip
        async with asyncio.timeout(60):
            while not any(c.log.chunks.values()):
                await asyncio.sleep(0.01)
        c.kill("w-a")
        timed_out = await c.log.wait_for(NodeTimedOut, timeout=30)
        assert timed_out.node_id == "w-a"
        again = await c.log.wait_for(InstancePlaced, lambda e: e.generation == 2, timeout=30)
        assert [s.node_id for s in again.shards] == ["w-b"] and "node w-a" in again.reason
        moved = await c.wait_serving("inst")
        assert moved.node_id == "w-b" and moved.runner_id == again.shards[0].runner_id

        answered = await during
        print("during:", *answered, sep="\n  ")
        check_answered(answered, errors_allowed=True)
        after = await load(["api"], c.apis, 4, label="after", concurrency=2)
        print("after:", *after, sep="\n  ")
        check_answered(after)

        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        check_answered([*answered, *after], errors_allowed=True, log=log)
        check_tasks_ended(log)
        served_by = {e.task_id: e.runner_id for e in log.of(TaskCompleted)}
        assert {served_by[o.task_id] for o in after if o.task_id} == {moved.runner_id}
