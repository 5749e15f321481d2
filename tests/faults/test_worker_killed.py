"""The test host that serves an instance dies (its worker and runner SIGKILLed at once), under
load through the API: its node times out, the instance is placed on the other worker's host and
serves again, and the tasks that were running on the lost node go on there, one that its runner
had pulled but not yet started included; every request is answered.

tests/services/planner/test_failover.py shows the re-placement itself with three workers and
tasks published directly; this is the same fault seen by API clients, with the invariants."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from bus.stores.claim_check import resolved
from bus.stores.parts import PartStore
from bus.streams import EVENTS_STREAM
from events.catalogue import InstancePlaced, NodeTimedOut, TaskCompleted, TaskCreated, TaskStarted
from services.runner import tasks_consumer_name
from tests.faults.cluster import MODEL, Cluster, running_cluster
from tests.faults.invariants import (
    Outcome,
    chat,
    check_answered,
    check_log_and_projection,
    check_tasks_ended,
    load,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STORY = "Write a long story about a fish."


# A prompt of about 1,500 tokens: seconds of reading on one thread.
LONG = " ".join(f"Fact {i}: the fish number {i} swims in the sea." for i in range(110))


async def asks(store: PartStore, task: TaskCreated, marker: str) -> bool:
    """Whether ``task``'s last message ends with ``marker`` (its messages are parts on the log,
    read back as the runner reads them)."""
    whole = await resolved(store, task)
    return whole.messages is not None and str(whole.messages[-1].content).endswith(marker)


async def pulled_not_started(c: Cluster, marker: str) -> str:
    """The id of the task whose last message ends with ``marker``, once a runner pulled it
    (the task consumer's one message in progress) and before its TaskStarted."""
    store, seen = PartStore(c.js), set[str]()
    task_id: str | None = None
    async with asyncio.timeout(60):
        while True:
            for e in c.log.of(TaskCreated, lambda e: e.task_id not in seen):
                seen.add(e.task_id)
                if task_id is None and await asks(store, e, marker):
                    task_id = e.task_id
            if task_id is not None:
                started = {e.task_id for e in c.log.of(TaskStarted)}
                assert task_id not in started, "too late: the task started already"
                info = await c.js.consumer_info(EVENTS_STREAM, tasks_consumer_name(MODEL))
                if info.num_ack_pending == 1:
                    return task_id
            await asyncio.sleep(0.005)


async def test_a_killed_worker_s_instance_serves_again_elsewhere(tmp_path: Path) -> None:
    async with running_cluster(tmp_path, hosts=2) as c:
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

        # Three long answers streaming from w-a when it is killed, and in its fourth slot a
        # long prompt being read: pulled, and not yet started in the log.
        stories = [Outcome(f"story{i}", "api", True) for i in range(3)]
        client = httpx.AsyncClient(timeout=httpx.Timeout(90, connect=10))
        streaming = [
            asyncio.create_task(
                chat(
                    client,
                    "api",
                    c.apis["api"],
                    label=o.label,
                    stream=True,
                    content=f"{STORY} Call it Fin {i}.",
                    max_tokens=120,
                    deadline_s=90,
                    out=o,
                )
            )
            for i, o in enumerate(stories)
        ]
        async with asyncio.timeout(60):
            while not all(o.task_id and len(c.log.chunks.get(o.task_id, [])) >= 5 for o in stories):
                await asyncio.sleep(0.01)
        reading = Outcome("reading", "api", False)
        streaming.append(
            asyncio.create_task(
                chat(
                    client,
                    "api",
                    c.apis["api"],
                    label="reading",
                    stream=False,
                    max_tokens=16,
                    content=f"{LONG} Sum it up.",
                    deadline_s=120,
                    out=reading,
                )
            )
        )
        pulled = await pulled_not_started(c, "Sum it up.")
        during = asyncio.create_task(
            load(["api"], c.apis, 8, label="during", concurrency=4, max_tokens=32, deadline_s=120)
        )
        # The machine is lost: its worker and its runner at once (a runner whose worker alone
        # dies finishes what it serves first).
        c.lose("w-a")
        timed_out = await c.log.wait_for(NodeTimedOut, timeout=30)
        assert timed_out.node_id == "w-a"
        again = await c.log.wait_for(InstancePlaced, lambda e: e.generation == 2, timeout=30)
        assert [s.node_id for s in again.shards] == ["w-b"] and "node w-a" in again.reason
        moved = await c.wait_serving("inst")
        assert moved.node_id == "w-b" and moved.runner_id == again.shards[0].runner_id

        answered = await during
        print("during:", *answered, sep="\n  ")
        # Queued while no runner served: they waited for w-b's (resume_within_s).
        check_answered(answered)
        # The answers streaming from w-a went on on w-b, their streams paused (a planner
        # resumed them: w-a's worker was gone).
        *told, read = await asyncio.gather(*streaming)
        await client.aclose()
        print("stories:", *told, read, sep="\n  ")
        check_answered([*told, read])
        assert all(o.finish_reason == "length" for o in told), told
        resumed = {e.task_id: e for e in c.log.of(TaskCreated, lambda e: e.resume is not None)}
        assert set(resumed) == {o.task_id for o in told} | {pulled}
        assert all(
            e.resume and "node w-a" in e.resume.reason and len(e.resume.tokens) >= 5
            for t, e in resumed.items()
            if t != pulled
        )
        # The task no event placed on w-a came again from JetStream (its ack wait passed).
        lost = resumed[pulled].resume
        assert lost and lost.tokens == [] and "lost before it started" in lost.reason
        after = await load(["api"], c.apis, 4, label="after", concurrency=2)
        print("after:", *after, sep="\n  ")
        check_answered(after)

        await c.stop_all_but_projector()
        log = await check_log_and_projection(c)
        check_answered([*answered, *after], log=log)
        check_answered(told, log=log)
        for o in told:
            assert o.task_id is not None
            assert sorted(ch.idx for ch in log.chunks[o.task_id]) == list(range(121))
        idx = sorted(ch.idx for ch in log.chunks[pulled])
        assert idx == list(range(len(idx))) and read.text
        check_tasks_ended(log)
        served_by = {e.task_id: e.runner_id for e in log.of(TaskCompleted)}
        assert {served_by[o.task_id] for o in after if o.task_id} == {moved.runner_id}
