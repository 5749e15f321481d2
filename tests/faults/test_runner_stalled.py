"""SIGSTOP the runner that pulled a streamed request, past the task consumer's ack wait (as swap,
or a paused VM, would stall it): the other replica continues the task, and when the stalled
runner wakes (SIGCONT) it publishes nothing more for it (its fence: services/runner/fence.py).
The client's answer is one attempt's, whole and valid, although the two attempts sample
differently."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from events.attempts import attempt_of, kept_chunks
from events.catalogue import RunnerStateChanged, TaskCompleted, TaskCreated, TaskStarted
from services.runner import ACK_WAIT_S, CurrentTasks
from tests.faults.cluster import Cluster, running_cluster
from tests.faults.invariants import (
    Outcome,
    chat,
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

STALL_S = 20.0  # past the ack wait (15 s)
# A long prompt: the runner is stopped while it reads it, before anything of the task is out.
STORY = "The sea was calm that morning, and the boats went out one by one. " * 60
ASK = f"{STORY}\nDescribe a person who lives in a city by the sea, as JSON."
PERSON = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {
            "type": "object",
            "required": ["name", "age", "city"],
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer"},
                "city": {"type": "string", "maxLength": 20},
            },
        },
    },
}
# Sampled, so that the two attempts (each with its own seed) would differ if both were shown.
SAMPLED = {"temperature": 1.0, "seed": 7, "response_format": PERSON}


def task_file(c: Cluster, node: str, runner: RunnerStateChanged) -> Path:
    return c.tmp / node / "logs" / f"runner-{runner.runner_id}.task"


async def puller(c: Cluster, node: str, ready: list[RunnerStateChanged]) -> RunnerStateChanged:
    """The runner that began on the (only) request: its task file lists it."""
    async with asyncio.timeout(60):
        while True:
            for runner in ready:
                if CurrentTasks.read(task_file(c, node, runner)):
                    return runner
            await asyncio.sleep(0.002)


async def test_a_runner_stalled_past_the_ack_wait_is_fenced_off(tmp_path: Path) -> None:
    async with running_cluster(tmp_path) as c:
        await c.start_projector()
        c.start_planner()
        await c.start_worker("w-a")
        url = await c.start_api()
        await c.add_model()
        await c.request_instance("inst", replicas=2)
        async with asyncio.timeout(90):
            while len(ready := await c.serving("inst")) < 2:
                await asyncio.sleep(0.1)

        async with httpx.AsyncClient(timeout=180) as client:
            out = Outcome("stalled", "api", True)
            streaming = asyncio.create_task(
                chat(
                    client,
                    "api",
                    url,
                    label="stalled",
                    stream=True,
                    content=ASK,
                    max_tokens=200,
                    deadline_s=180,
                    out=out,
                    extra=SAMPLED,
                )
            )
            stalled = await puller(c, "w-a", ready)
            assert stalled.pid is not None
            os.kill(stalled.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            ((task_id, _, attempt),) = CurrentTasks.read(task_file(c, "w-a", stalled))
            assert attempt == 0
            other = next(r for r in ready if r.runner_id != stalled.runner_id)
            try:
                # Nothing of the task is out: only JetStream's redelivery can tell.
                assert not c.log.of(TaskStarted, lambda e: e.task_id == task_id)
                continued = await c.log.wait_for(
                    TaskCreated,
                    lambda e: e.task_id == task_id and e.resume is not None,
                    timeout=ACK_WAIT_S + 10,
                )
                await asyncio.sleep(max(0.0, STALL_S - (time.monotonic() - stopped_at)))
            finally:
                os.kill(stalled.pid, signal.SIGCONT)
            woke_at = time.monotonic()
            # The woken runner sees it was continued and drops the task (its task file empties).
            async with asyncio.timeout(60):
                while CurrentTasks.read(task_file(c, "w-a", stalled)):
                    await asyncio.sleep(0.01)
            dropped_s = time.monotonic() - woke_at
            stalled_out = await streaming
            # Both replicas serve on.
            after = [
                await chat(client, "api", url, label=f"after{i}", stream=i == 0) for i in range(3)
            ]

        assert stalled_out.kind == "completed" and stalled_out.finish_reason == "stop", stalled_out
        assert json.loads(stalled_out.text).keys() == {"name", "age", "city"}, stalled_out
        assert stalled_out.task_id == task_id
        check_answered(after)
        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        check_answered([stalled_out, *after], log=log)
        check_tasks_ended(log)

        # Continued by the other replica, from nothing (the stalled runner had published none).
        assert continued.resume is not None and continued.resume.attempt == 1
        assert continued.resume.tokens == [] and "before it started" in continued.resume.reason
        starts = [e.runner_id for e in log.of(TaskStarted) if e.task_id == task_id]
        assert starts == [other.runner_id]
        # Every chunk is the continuation's, 0..n once each, and the client's text is theirs.
        chunks = log.chunks[task_id]
        assert {ch.attempt for ch in chunks} == {1}, "the woken runner published chunks"
        assert sorted(ch.idx for ch in chunks) == list(range(len(chunks)))
        kept = kept_chunks(chunks, attempt_of(continued))
        assert "".join(kept[i].text for i in sorted(kept)) == stalled_out.text
        outcomes = [e for e in log.of(TaskCompleted) if e.task_id == task_id]
        assert [(e.attempt, e.runner_id) for e in outcomes] == [(1, other.runner_id)]
        # It was only stalled: it never failed, and said so in its log.
        assert not c.log.of(
            RunnerStateChanged,
            lambda e: e.runner_id == stalled.runner_id and e.state == "Failed",
        )
        runner_log = (tmp_path / "w-a" / "logs" / f"runner-{stalled.runner_id}.log").read_text()
        assert "was continued elsewhere" in runner_log
        pause = stalled_out.seconds
        print(
            f"stalled {STALL_S:.0f} s: the answer came after {pause:.1f} s (the ack wait,"
            f" {ACK_WAIT_S:.0f} s, then the other replica's prefill and generation); the woken"
            f" runner dropped the task {dropped_s:.2f} s after SIGCONT"
        )
