"""A task whose ``TaskCreated`` the log lost after acknowledging it (a power cut took the
nats-server's unsynced tail): the API's stream gives it up once, with a clear reason, and
cancels it for a runner that may have it, rather than wait until its timeout (real nats-server;
the loss played by purging the task's subject)."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js import JetStreamContext

from api.errors import ApiError
from api.serving import _outcomes
from api.task_stream import LOST, TaskStream, request_gone
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM
from events.catalogue import EmbeddingsRequested, TaskCancelled, TaskCreated

TASK = TaskCreated(task_id="t-lost", model_id="m", origin="api", prompt="hi", kind="completion")


async def test_a_task_the_log_lost_is_given_up_once(nc: Client, js: JetStreamContext) -> None:
    async with TaskStream(nc, TASK, origin="api", timeout_s=30) as stream:
        await js.purge_stream(EVENTS_STREAM, subject=TASK.subject)
        started = asyncio.get_running_loop().time()
        groups = [g async for g in stream.chunk_groups()]
        waited = asyncio.get_running_loop().time() - started
    assert groups == [] and waited < 10  # noticed at the first quiet spell, not the timeout
    assert stream.finished is not None and stream.finished.lost == LOST

    class _Metrics:
        def task_served(self, _ts: TaskStream) -> None:
            pass

    class _Ctx:
        metrics = _Metrics()

    try:
        _outcomes(_Ctx(), [stream])  # type: ignore[arg-type]
    except ApiError as err:
        assert (err.status, err.code) == (503, "request_lost")
        assert "send it again" in str(err.message)
    else:
        raise AssertionError("a lost request must be an error")

    # A runner that had it is told to stop, once.
    cancelled = TaskCancelled.subject_for("m", "t-lost")
    async with asyncio.timeout(10):
        while (await js.stream_info(EVENTS_STREAM, subjects_filter=cancelled)).state.messages < 1:
            await asyncio.sleep(0.05)
    msg = await js.get_last_msg(EVENTS_STREAM, cancelled)
    assert b"lost this request" in (msg.data or b"")


async def test_an_embeddings_request_the_log_lost_is_told_from_one_it_holds(
    nc: Client, js: JetStreamContext
) -> None:
    task = EmbeddingsRequested(task_id="e-lost", model_id="m", origin="api", texts=["a"])
    await Publisher(js).publish(task)
    assert not await request_gone(nc, task)
    await js.purge_stream(EVENTS_STREAM, subject=task.subject)
    assert await request_gone(nc, task)
