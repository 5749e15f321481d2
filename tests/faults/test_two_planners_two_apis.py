"""Two planners and two API processes at once, under load: one decision per instance
generation, an instance requested through one API and deleted through the other, every request
answered."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from events.catalogue import (
    InstanceDeleted,
    InstancePlaced,
    InstanceRequested,
    RunnerStateChanged,
    TaskCompleted,
    TaskStarted,
)
from tests.faults.cluster import MODEL, Cluster, running_cluster
from tests.faults.invariants import (
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
    load,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def _create(client: httpx.AsyncClient, url: str) -> str:
    r = await client.post(f"{url}/v1/instances", json={"model": MODEL})
    assert r.status_code == 202, r.text
    instance_id: str = r.json()["id"]
    return instance_id


async def _instance(client: httpx.AsyncClient, url: str, instance_id: str) -> dict[str, Any]:
    r = await client.get(f"{url}/v1/instances/{instance_id}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _already_decided(c: Cluster) -> int:
    """How many decisions a planner found already made by the other (its log says so)."""
    return sum(len(re.findall("already decided", c.procs.log(p))) for p in ("p1", "p2"))


async def test_two_planners_and_two_apis_under_load(tmp_path: Path) -> None:
    async with running_cluster(tmp_path, hosts=2) as c:
        await c.start_projector()
        c.start_planner("p1")
        c.start_planner("p2")
        await c.start_worker("w-a")
        await c.start_worker("w-b")
        one, two = await c.start_api("api-1"), await c.start_api("api-2")
        await c.add_model()

        async with httpx.AsyncClient(timeout=30) as client:
            # One instance asked for through each API; both serve.
            serving = [await _create(client, one), await _create(client, two)]
            for instance_id in serving:
                await c.wait_serving(instance_id)

            # 40 requests over both APIs, in two waves. Meanwhile a third instance is asked for
            # through api-1, and deleted through api-2 while its runner serves the second wave.
            spread = ["api-1", "api-2"]
            first = asyncio.create_task(load(spread, c.apis, 20, label="a", deadline_s=90))
            # The projector held back a moment (SIGSTOP): both planners wait for it to apply
            # the request, then decide at about the same time, the same generation. (Often both
            # publish and JetStream keeps one; or one sees the other's decision already applied.)
            projector = c.procs.procs["projector"]
            os.kill(projector.pid, signal.SIGSTOP)
            try:
                extra = await _create(client, one)
                await c.log.wait_for(InstanceRequested, lambda e: e.instance_id == extra)
                await asyncio.sleep(0.5)  # the planners see it and wait for the projection
            finally:
                os.kill(projector.pid, signal.SIGCONT)
            ready = await c.wait_serving(extra)
            second = asyncio.create_task(load(spread, c.apis, 20, label="b", deadline_s=90))
            await c.log.wait_for(TaskStarted, lambda e: e.runner_id == ready.runner_id)
            r = await client.delete(f"{two}/v1/instances/{extra}")
            assert r.status_code == 202, r.text
            assert not second.done()
            await c.log.wait_for(InstanceDeleted, lambda e: e.instance_id == extra)
            await c.log.wait_for(
                RunnerStateChanged,
                lambda e: e.runner_id == ready.runner_id and e.state == "Stopped",
            )
            outcomes = await first + await second
            print(*outcomes, sep="\n")
            check_answered(outcomes)
            # Both APIs read the same projection.
            await c.wait_applied(await c.last_seq())
            for url in (one, two):
                assert (await _instance(client, url, extra))["status"] == "deleted"
                for instance_id in serving:
                    assert (await _instance(client, url, instance_id))["status"] == "placed"
            r = await client.delete(f"{one}/v1/instances/{extra}")
            assert r.status_code == 404  # deleted is deleted, whichever API is asked

        print(f"{_already_decided(c)} decision(s) made by both planners, stored once")
        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)  # one decision per generation among them
        check_answered(outcomes, log=log)
        check_tasks_ended(log)
        placed = log.of(InstancePlaced)
        assert sorted((e.instance_id, e.generation) for e in placed) == sorted(
            (i, 1) for i in [*serving, extra]
        )
        assert [e.instance_id for e in log.of(InstanceDeleted)] == [extra]
        # The load was spread over the three runners; the deleted one finished what it took.
        served_by = {e.runner_id for e in log.of(TaskCompleted)}
        assert len(served_by) == 3 and ready.runner_id in served_by
