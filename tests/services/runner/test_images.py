"""A task's images as the runner reads them (services/runner/images.py): their bytes for an
engine that reads images (llama.cpp with the model's projector), a clear refusal from any
other, never served as if its images were not there."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from nats.js import JetStreamContext

from bus.stores.images import stored_image
from bus.stores.parts import PartStore
from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams
from harness.images import png
from harness.models.templated import SMOLLM2
from inference.engines.base import Engine
from inference.engines.llamacpp.engine import LlamaCppEngine
from services.runner.images import images_for, reads_images
from structured.reply import InvalidRequest

OTHER = cast(Engine, object())  # an engine with no say on images (MLX's)


def _task(*messages: ChatMessage) -> TaskCreated:
    return TaskCreated(
        task_id="t",
        model_id="smollm2-135m",
        origin="test",
        kind="chat",
        messages=list(messages),
        params=SamplingParams(),
    )


async def test_the_images_bytes_for_an_engine_that_reads_them_else_a_refusal(
    js: JetStreamContext, tiny_projector: Path
) -> None:
    store = PartStore(js)
    data = png()
    image, parts = stored_image(data, "image/png", 2, 2)
    await store.store(parts)
    seeing = _task(ChatMessage(role="user", content="What is this?", images=[image]))
    # Not loaded: whether it reads images is its projector's say.
    reader = LlamaCppEngine(SMOLLM2, projector=tiny_projector)
    assert reads_images(reader)
    assert await images_for(store, reader, seeing) == {image.sha256: data}

    text_only = LlamaCppEngine(SMOLLM2)
    assert not reads_images(OTHER) and not reads_images(text_only)
    assert await images_for(store, OTHER, _task(ChatMessage(role="user", content="hi"))) == {}
    refusals = (
        (OTHER, "does not accept images on this engine.*split over MLX ranks reads text only"),
        (text_only, "does not accept images: its model has no projector"),
    )
    for engine, why in refusals:
        with pytest.raises(InvalidRequest, match=f"model smollm2-135m {why}"):
            await images_for(store, engine, seeing)
