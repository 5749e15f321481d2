"""A task's images as the runner reads them (services/runner/images.py): refused while no
engine reads images, never served as if they were not there."""

from __future__ import annotations

from typing import cast

import pytest
from nats.js import JetStreamContext

from bus.events import TaskCreated
from bus.images import stored_image
from bus.parts import PartStore
from bus.records import ChatMessage, SamplingParams
from services.runner.engines.base import Engine
from services.runner.generation import InvalidRequest
from services.runner.images import images_for, reads_images
from tests.images import png

ENGINE = cast(Engine, object())


def _task(*messages: ChatMessage) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="smollm2-135m",
        origin="test",
        kind="chat",
        messages=list(messages),
        params=SamplingParams(),
    )


async def test_a_task_with_an_image_is_refused_by_an_engine_that_reads_none(
    js: JetStreamContext,
) -> None:
    store = PartStore(js)
    assert not reads_images(ENGINE)
    assert await images_for(store, ENGINE, _task(ChatMessage(role="user", content="hi"))) == {}
    image, parts = stored_image(png(), "image/png", 2, 2)
    await store.store(parts)
    seeing = _task(ChatMessage(role="user", content="What is this?", images=[image]))
    with pytest.raises(InvalidRequest, match="model smollm2-135m does not accept images"):
        await images_for(store, ENGINE, seeing)
