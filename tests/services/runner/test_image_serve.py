"""An image model's runner (``ImageServer``) in process, on the tiny random-weight Stable
Diffusion pipeline and a real nats-server: a step event per step and the PNG stored by digest,
a cancel that stops it mid-way, a continuation generated again from step 0 with the same
images, and requests it cannot serve failed with a reason."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.publisher import Publisher
from bus.stores.images import image_bytes
from bus.stores.parts import PartStore
from events.catalogue import (
    ImageGenerated,
    ImageStepped,
    Resume,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
)
from events.records import ImageParams
from inference.engines.diffusion.engine import DiffusersEngine
from services.runner.image_serve import ImageServer
from services.runner.state_reporter import RunnerIdentity
from tests.services.event_log import EventLog
from tests.tiny_diffusion import tiny_diffusion_pipeline

pytestmark = pytest.mark.slow

MODEL = "tiny-sd"


def _task(task_id: str, params: ImageParams, resume: Resume | None = None) -> TaskCreated:
    return TaskCreated(
        task_id=task_id,
        model_id=MODEL,
        origin="t",
        kind="image",
        prompt="a red cat",
        image=params,
        resume=resume,
    )


@pytest.fixture
async def serving(nc: Client, js: JetStreamContext) -> AsyncIterator[EventLog]:
    log = await EventLog().start(js)
    engine = DiffusersEngine(tiny_diffusion_pipeline(), n_threads=1)
    await asyncio.to_thread(engine.load)
    server = ImageServer(nc, engine, RunnerIdentity("img-r", "img-i", MODEL, "n"))
    await server.start()
    stop = asyncio.Event()
    running = asyncio.create_task(server.serve_forever(stop))
    try:
        yield log
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await log.stop()


async def test_steps_then_the_stored_png_then_the_outcome(
    serving: EventLog, js: JetStreamContext
) -> None:
    await Publisher(js).publish(_task("i1", ImageParams(n=2, width=64, height=64, steps=2, seed=1)))
    done = await serving.wait_for(TaskCompleted, lambda e: e.task_id == "i1", timeout=60)
    steps = serving.of(ImageStepped, lambda e: e.task_id == "i1")
    assert [(s.image, s.step, s.steps) for s in steps] == [
        (0, 1, 2),
        (0, 2, 2),
        (1, 1, 2),
        (1, 2, 2),
    ]
    images = serving.of(ImageGenerated, lambda e: e.task_id == "i1")
    assert [(i.index, i.partial, i.seed) for i in images] == [(0, None, 1), (1, None, 2)]
    png = await image_bytes(PartStore(js), images[0].png)
    assert png.startswith(b"\x89PNG") and len(png) == images[0].png.bytes
    assert done.finish_reason == "stop" and done.usage.completion_tokens == 4


async def test_a_cancel_stops_it_mid_way(serving: EventLog, js: JetStreamContext) -> None:
    pub = Publisher(js)
    await pub.publish(_task("i2", ImageParams(width=256, height=256, steps=150, seed=2)))
    await serving.wait_for(ImageStepped, lambda e: e.task_id == "i2" and e.step >= 2, timeout=60)
    await pub.publish(TaskCancelled(task_id="i2", model_id=MODEL, origin="t"))
    done = await serving.wait_for(TaskCompleted, lambda e: e.task_id == "i2", timeout=60)
    assert done.finish_reason == "cancelled"
    assert done.usage.completion_tokens < 150
    assert not serving.of(ImageGenerated, lambda e: e.task_id == "i2")


async def test_a_continuation_is_generated_again_from_step_0(
    serving: EventLog, js: JetStreamContext
) -> None:
    """Its runner lost (as its worker would publish it): attempt 1 steps from 1 again, and its
    image is attempt 0's, drawn with the same seed."""
    pub = Publisher(js)
    params = ImageParams(width=64, height=64, steps=3, seed=9)
    await pub.publish(_task("i3", params))
    await serving.wait_for(TaskCompleted, lambda e: e.task_id == "i3", timeout=60)
    await pub.publish(_task("i3", params, resume=Resume(attempt=1, reason="runner lost")))
    await serving.wait_for(
        TaskCompleted, lambda e: e.task_id == "i3" and e.attempt == 1, timeout=60
    )
    again = serving.of(ImageStepped, lambda e: e.task_id == "i3" and e.attempt == 1)
    assert [s.step for s in again] == [1, 2, 3]
    images = {i.attempt: i.png.sha256 for i in serving.of(ImageGenerated) if i.task_id == "i3"}
    assert set(images) == {0, 1} and images[0] == images[1]


async def test_what_it_cannot_serve_fails_saying_why(
    serving: EventLog, js: JetStreamContext
) -> None:
    pub = Publisher(js)
    await pub.publish(_task("i4", ImageParams(width=100, height=64, steps=1)))
    await pub.publish(TaskCreated(task_id="i5", model_id=MODEL, origin="t", prompt="hi"))
    await serving.wait_count(TaskFailed, lambda e: e.task_id in ("i4", "i5"), 2, timeout=60)
    failed = {e.task_id: e.error for e in serving.of(TaskFailed)}
    assert failed["i4"].startswith("invalid request: size 100x64") and "width" in failed["i4"]
    assert failed["i5"] == f"invalid request: model {MODEL} makes images only"
