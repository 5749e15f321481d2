"""The API's side of a task continued while its first runner was only stalled: the stream takes
the chunks and the outcome of the newest attempt, whatever the woken runner sends (on a real
nats-server, the runners played by the test)."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js import JetStreamContext

from api.task_stream import TaskStream
from bus.publisher import ChunkPublisher, Publisher
from events.attempts import chunk_msg_id, outcome_msg_id
from events.catalogue import ChunkGenerated, Resume, TaskCompleted, TaskCreated
from events.records import Timings, Usage

TASK = TaskCreated(task_id="t", model_id="m", origin="api", prompt="hi", kind="completion")


def chunk(idx: int, attempt: int, final: bool = False) -> ChunkGenerated:
    return ChunkGenerated(
        task_id="t",
        idx=idx,
        text=f"{attempt}:{idx} ",
        token_id=None if final else idx,
        finish_reason="stop" if final else None,
        attempt=attempt,
        origin=f"r{attempt}",
    )


def completed(attempt: int, tokens: int) -> TaskCompleted:
    return TaskCompleted(
        task_id="t",
        model_id="m",
        origin=f"r{attempt}",
        runner_id=f"r{attempt}",
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=tokens),
        timings=Timings(ttft_ms=1.0, tokens_per_s=1.0, total_ms=1.0),
        attempt=attempt,
    )


async def test_the_stream_is_the_newest_attempts_whatever_a_woken_runner_sends(
    nc: Client, js: JetStreamContext
) -> None:
    events, chunks = Publisher(js), ChunkPublisher(js)

    async def send(*out: ChunkGenerated) -> None:
        for c in out:
            await chunks.publish(c, msg_id=chunk_msg_id("t", c.attempt or 0, c.idx))
        await chunks.flush()

    async with TaskStream(nc, TASK, origin="api", timeout_s=20) as stream:
        got: list[list[ChunkGenerated]] = []

        async def follow() -> None:
            async for group in stream.chunk_groups():
                got.append(group)

        following = asyncio.create_task(follow())
        await send(chunk(0, 0), chunk(1, 0))  # the first runner, then it stalls
        # Continued after those two tokens, on the other replica.
        resume = Resume(attempt=1, tokens=[0, 1], runner_id="r0", reason="lost")
        continued = TASK.model_copy(update={"resume": resume, "origin": "r1"})
        await events.publish(continued, msg_id="resume:t:1")
        # The first runner wakes and sends what it had made, and even its outcome (the race
        # its fence leaves: both went out before it read the log).
        await send(chunk(2, 0), chunk(3, 0, final=True))
        await events.publish(completed(0, 3), msg_id=outcome_msg_id("t", 0))
        await asyncio.sleep(0.3)
        assert not following.done()  # the older attempt's outcome did not end it
        await send(chunk(2, 1), chunk(3, 1), chunk(4, 1, final=True))
        await events.publish(completed(1, 4), msg_id=outcome_msg_id("t", 1))
        await asyncio.wait_for(following, 10)

    text = "".join(c.text for group in got for c in group)
    assert text == "0:0 0:1 1:2 1:3 1:4 "
    assert [c.idx for group in got for c in group] == [0, 1, 2, 3, 4]
    finished = stream.finished
    assert finished is not None and finished.completed is not None
    assert finished.completed.attempt == 1 and finished.completed.usage.completion_tokens == 4
