"""SIGKILL a runner in the middle of a streamed chat: the worker restarts it and the task goes on
from the log (the client's stream pauses, then finishes with the text an uninterrupted run
gives), and the next requests succeed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM
from events.catalogue import RunnerStateChanged, TaskCreated, TaskStarted
from events.subjects import chunk_subject
from tests.faults.cluster import Cluster, running_cluster
from tests.faults.invariants import (
    Log,
    Outcome,
    chat,
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STORY = "Write a long story about a fish."
PERSON_ASK = "Describe a person who lives in a city by the sea, as JSON."
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


async def stored_chunks(c: Cluster, task_id: str) -> int:
    return len([m async for m in read_stream(c.js, CHUNKS_STREAM, chunk_subject(task_id))])


def pause_s(log: Log, task_id: str, at: int) -> float:
    """How long the stream stood still at chunk ``at``: from the chunk before to it."""
    ts = {chunk.idx: chunk.ts for chunk in log.chunks[task_id]}
    return (ts[at] - ts[at - 1]).total_seconds()


async def killed_after(c: Cluster, out: Outcome, chunks: int, pid: int) -> None:
    """SIGKILL ``pid`` once the log holds ``chunks`` of the streamed answer."""
    async with asyncio.timeout(60):
        while out.task_id is None or await stored_chunks(c, out.task_id) < chunks:
            await asyncio.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


async def test_a_runner_killed_mid_stream_goes_on_from_the_log(tmp_path: Path) -> None:
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
            reference = await chat(
                client, "api", url, label="whole", stream=True, content=STORY, max_tokens=120
            )
            out = Outcome("killed", "api", True)
            streaming = asyncio.create_task(
                chat(
                    client,
                    "api",
                    url,
                    label="killed",
                    stream=True,
                    content=STORY,
                    max_tokens=120,
                    out=out,
                )
            )
            await killed_after(c, out, 20, ready.pid)
            killed = await streaming

            # The worker reports the death and starts the runner again...
            dead = await c.log.wait_for(
                RunnerStateChanged,
                lambda e: e.runner_id == ready.runner_id and e.state == "Failed",
            )
            assert dead.exit_code == -signal.SIGKILL
            again = await c.wait_serving("inst")
            assert again.runner_id == ready.runner_id and again.pid != ready.pid
            # ...which goes on with the task: the stream finished as if nothing happened.
            assert killed.kind == "completed" and killed.done, killed
            assert killed.text == reference.text and killed.finish_reason == "length"
            resumed = await c.log.wait_for(
                TaskCreated, lambda e: e.task_id == killed.task_id and e.resume is not None
            )
            assert resumed.resume is not None and resumed.resume.attempt == 1
            assert len(resumed.resume.tokens) >= 20
            assert resumed.resume.runner_id == ready.runner_id
            after = [
                await chat(client, "api", url, label=f"after{i}", stream=i == 0) for i in range(2)
            ]
            # A JSON reply cut mid-object goes on under its schema: still valid JSON.
            shaped = Outcome("json", "api", True)
            asking = asyncio.create_task(
                chat(
                    client,
                    "api",
                    url,
                    label="json",
                    stream=True,
                    content=PERSON_ASK,
                    max_tokens=200,
                    out=shaped,
                    extra={"response_format": PERSON},
                )
            )
            assert again.pid is not None
            await killed_after(c, shaped, 10, again.pid)
            shaped = await asking
            assert shaped.kind == "completed" and shaped.finish_reason == "stop", shaped
            assert json.loads(shaped.text).keys() == {"name", "age", "city"}, shaped

        check_answered(after)
        assert all("Paris" in o.text for o in after), after
        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        check_answered([reference, killed, *after, shaped], log=log)
        check_tasks_ended(log)
        # Each chunk once, 0..n: the continuation went on at the next index.
        assert killed.task_id is not None
        idx = [chunk.idx for chunk in log.chunks[killed.task_id]]
        assert sorted(idx) == list(range(len(idx))) and len(idx) == 121
        task = await c.task(killed.task_id)
        assert task is not None and task.resumes == 1 and task.status == "completed"
        assert task.completion_tokens == 120
        # The pause: the runner's restart (from its death to Ready again) and a prefill.
        pause = pause_s(log, killed.task_id, len(resumed.resume.tokens))
        restart = (again.ts - dead.ts).total_seconds()
        print(
            f"one replica: the stream paused {pause:.2f} s (the runner restarted in "
            f"{restart:.2f} s)"
        )
        assert pause <= restart + 2.0


async def test_a_replicas_runner_killed_mid_stream_goes_on_on_the_other(tmp_path: Path) -> None:
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
        async with httpx.AsyncClient(timeout=60) as client:
            out = Outcome("killed", "api", True)
            streaming = asyncio.create_task(
                chat(
                    client,
                    "api",
                    url,
                    label="killed",
                    stream=True,
                    content=STORY,
                    max_tokens=120,
                    out=out,
                )
            )
            async with asyncio.timeout(60):
                while out.task_id is None or not c.log.of(
                    TaskStarted, lambda e: e.task_id == out.task_id
                ):
                    await asyncio.sleep(0.02)
            first = c.log.of(TaskStarted, lambda e: e.task_id == out.task_id)[0]
            serving = next(r for r in ready if r.runner_id == first.runner_id)
            other = next(r for r in ready if r.runner_id != first.runner_id)
            assert serving.pid is not None
            await killed_after(c, out, 20, serving.pid)
            killed = await streaming
        assert killed.kind == "completed" and killed.finish_reason == "length", killed
        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        check_answered([killed], log=log)
        check_tasks_ended(log)
        assert killed.task_id is not None
        resumed = next(e for e in log.of(TaskCreated) if e.resume and e.task_id == killed.task_id)
        assert resumed.resume is not None
        # The other replica took it at once, while the killed runner was still restarting.
        starts = [e.runner_id for e in log.of(TaskStarted) if e.task_id == killed.task_id]
        assert starts == [serving.runner_id, other.runner_id]
        pause = pause_s(log, killed.task_id, len(resumed.resume.tokens))
        print(f"two replicas: the stream paused {pause:.2f} s")
        assert pause <= 2.0
