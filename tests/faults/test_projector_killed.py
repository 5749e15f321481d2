"""SIGKILL the projector while it catches up with a backlog, twice: each restart resumes exactly
where the last commit left it, and the projection equals a replay of the log."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from harness.history import history
from tests.faults.cluster import Cluster, running_cluster
from tests.faults.invariants import check_log_and_projection
from tests.projectors.helpers import publish_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N_TASKS = 6000  # about 18,700 events: nine batches of 2,000 (the CLI default) and some


async def _kill_mid_catch_up(c: Cluster, name: str, last: int) -> int:
    """Start a projector and SIGKILL it as soon as it has committed part of the backlog;
    the sequence it had committed."""
    before = await c.applied_seq()
    c.procs.start(name, "projector", "--nats", c.nats.url, "--db", c.db_url)
    async with asyncio.timeout(60):
        while not before < (seq := await c.applied_seq()):
            assert c.procs.procs[name].poll() is None, c.procs.log(name)
            await asyncio.sleep(0.002)
    c.kill(name)
    killed_at = await c.applied_seq()
    assert before < killed_at < last, (before, killed_at, last)  # caught part-way
    assert killed_at >= seq
    return killed_at


def _resumed_after(log: str) -> int:
    found = re.search(r"resuming after seq (\d+)", log)
    assert found is not None, log
    return int(found.group(1))


async def test_a_projector_killed_while_catching_up_resumes_exactly(tmp_path: Path) -> None:
    async with running_cluster(tmp_path) as c:
        events = [e for e in history(n_tasks=N_TASKS, seed=11) if e.type != "ChunkGenerated"]
        last = await publish_all(c.js, events)
        assert last == len(events)

        first = await _kill_mid_catch_up(c, "projector-1", last)
        second = await _kill_mid_catch_up(c, "projector-2", last)
        # Each start read the tracking row: the second resumed after the first's last commit.
        assert _resumed_after(c.procs.log("projector-2")) == first
        assert first < second

        await c.start_projector("projector-3")
        assert _resumed_after(c.procs.log("projector-3")) == second
        await c.wait_applied(last)
        log = await check_log_and_projection(c)
        assert len(log.events) == last

        # Nothing left for the durable consumer to deliver or to have acked.
        async with asyncio.timeout(30):
            while True:
                info = await c.js.consumer_info("SHOAL_EVENTS", "projector-main")
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.1)
        print(f"killed at seq {first} and {second} of {last}; resumed exactly")
