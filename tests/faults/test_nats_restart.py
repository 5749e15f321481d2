"""Restart the only nats-server under load: every service reconnects and carries on, no stored
event is lost, requests in flight complete or fail clearly, requests afterwards succeed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from bus.streams import EVENTS_STREAM
from events.catalogue import InstancePlaced, ResourceProfiled
from services.runner import tasks_consumer_name
from tests.faults.cluster import MODEL, running_cluster
from tests.faults.invariants import (
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
    load,
    read_log,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
async def test_a_restarted_nats_server_loses_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    async with running_cluster(tmp_path) as c:
        await c.start_projector()
        c.start_planner()
        await c.start_worker("w-a")
        await c.start_api("api")
        # An API that comes back after the runner has published more of its streams (paused
        # across the restart): what its subscriptions missed is in the log.
        await c.start_api("api-late")
        late = c.procs.procs["api-late"]
        await c.add_model()
        await c.request_instance("inst")
        await c.wait_serving("inst")

        # Requests in flight on both APIs: a stream is under way when the server goes.
        in_flight = asyncio.create_task(
            load(["api", "api-late"], c.apis, 6, label="during", concurrency=6, deadline_s=45)
        )
        async with asyncio.timeout(60):
            while not any(c.log.chunks.values()):
                await asyncio.sleep(0.01)
        seen_events = list(c.log.events)
        seen_chunks = {task_id: list(chunks) for task_id, chunks in c.log.chunks.items()}
        restarted_at = time.monotonic()
        os.kill(late.pid, signal.SIGSTOP)
        try:
            await c.restart_nats(sig, down_s=0.5)
            back_at = time.time()
            await asyncio.sleep(2)  # the runner goes on publishing while api-late is away
        finally:
            os.kill(late.pid, signal.SIGCONT)
        during = await in_flight
        print("during:", *during, sep="\n  ")
        check_answered(during, errors_allowed=True)

        # Every event stored before the restart is still there, in its place.
        stored = await read_log(c.js)
        assert [e for _, e in stored.events[: len(seen_events)]] == seen_events
        for task_id, chunks in seen_chunks.items():
            assert set(chunks) <= set(stored.chunks[task_id])

        # Every service is back: the worker beats, the planner places and the worker starts
        # the runner of a new instance, the API and the runner serve.
        await c.fresh_log()
        await c.log.wait_for(ResourceProfiled, lambda e: e.ts.timestamp() > back_at)
        await c.request_instance("inst-2")
        await c.log.wait_for(InstancePlaced, lambda e: e.instance_id == "inst-2", timeout=60)
        await c.wait_serving("inst-2")
        back_s = time.monotonic() - restarted_at
        after = await load(["api", "api-late"], c.apis, 6, label="after", concurrency=3)
        print("after:", *after, sep="\n  ")
        check_answered(after)
        async with httpx.AsyncClient() as client:
            for url in c.apis.values():
                health = (await client.get(f"{url}/healthz")).json()
                assert health == {"status": "ok", "nats": True, "database": True}

        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        # The durable consumers came through: every task was delivered to a runner, every
        # event to the projector.
        for durable in ("projector-main", tasks_consumer_name(MODEL)):
            assert (await c.js.consumer_info(EVENTS_STREAM, durable)).num_pending == 0
        check_answered([*during, *after], errors_allowed=True, log=log)
        check_tasks_ended(log)
        print(f"back in {back_s:.1f} s")
