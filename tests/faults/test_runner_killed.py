"""SIGKILL a runner in the middle of a streamed chat: the client gets an error event in the
stream, the worker restarts the runner, the next request succeeds."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from bus.events import RunnerStateChanged, TaskFailed
from tests.faults.cluster import running_cluster
from tests.faults.invariants import (
    chat,
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_a_runner_killed_mid_stream(tmp_path: Path) -> None:
    async with running_cluster(tmp_path) as c:
        await c.start_projector()
        c.start_planner()
        await c.start_worker("w-a")
        url = await c.start_api()
        await c.add_model()
        await c.request_instance("inst")
        ready = await c.wait_serving("inst")
        row = await c.runner(ready.runner_id)
        assert ready.pid is not None and row is not None and row.pid == ready.pid

        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.Event()
            streaming = asyncio.create_task(
                chat(client, "api", url, label="killed", stream=True, first_chunk=first,
                     content="Write a long story about a fish.", max_tokens=400)
            )  # fmt: skip
            async with asyncio.timeout(60):
                await first.wait()
            os.kill(ready.pid, signal.SIGKILL)
            killed = await streaming

            # The stream ended with OpenAI's error object, saying what happened, then [DONE].
            assert killed.kind == "error" and killed.done, killed
            assert killed.chunks >= 1 and killed.finish_reason is None, killed
            assert killed.error is not None and killed.error["code"] == "task_failed"
            assert "killed by SIGKILL" in killed.error["message"], killed.error
            failed = await c.log.wait_for(TaskFailed, lambda e: e.task_id == killed.task_id)
            assert failed.runner_id == ready.runner_id

            # The worker reports the death and starts the runner again; it serves.
            dead = await c.log.wait_for(
                RunnerStateChanged,
                lambda e: e.runner_id == ready.runner_id and e.state == "Failed",
            )
            assert dead.exit_code == -signal.SIGKILL
            again = await c.wait_serving("inst")
            assert again.runner_id == ready.runner_id and again.pid != ready.pid
            after = [
                await chat(client, "api", url, label=f"after{i}", stream=i == 0) for i in range(2)
            ]

        check_answered(after)
        assert all("Paris" in o.text for o in after), after
        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        check_answered([killed, *after], errors_allowed=True, log=log)
        check_tasks_ended(log)
