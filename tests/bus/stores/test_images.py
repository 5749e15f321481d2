"""Images stored by digest as prompt parts (bus/stores/images.py), and read back by the runner's
resolver, on a real nats-server."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from nats.js import JetStreamContext

from bus.payload import max_payload
from bus.stores.claim_check import checked_in, resolved
from bus.stores.images import (
    IMAGE_PIECE_BYTES,
    image_bytes,
    piece_bytes,
    stored_image,
    task_images,
)
from bus.stores.parts import PARTS_STREAM, PartMissing, PartStore, part_subject
from events.catalogue import TaskCreated
from events.images import content_pieces, images_of
from events.records import ChatMessage, ImagePart, SamplingParams
from harness.images import png


def test_an_image_is_a_chain_of_pieces_named_by_its_own_digest() -> None:
    data = os.urandom(IMAGE_PIECE_BYTES * 2 + 5)
    image, parts = stored_image(data, "image/png", 3, 4)
    assert image.sha256 == hashlib.sha256(data).hexdigest() and image.bytes == len(data)
    assert (image.width, image.height, image.media_type, image.at) == (3, 4, "image/png", 0)
    assert len(parts) == 3 and image.ref.parts == 3 and image.ref.digest == parts[-1].digest
    # The same bytes make the same chain: stored once, however they came.
    again, same = stored_image(data, "image/png", 3, 4)
    assert again == image and [p.digest for p in same] == [p.digest for p in parts]
    # Each piece fits in a NATS message of the default 1 MiB, as a part with its parent.
    assert max(len(p.body) for p in parts) < 1024 * 1024
    assert piece_bytes(1024 * 1024) == IMAGE_PIECE_BYTES
    small = piece_bytes(64 * 1024)
    assert small % 3 == 0 and small < IMAGE_PIECE_BYTES
    assert max(len(p.body) for p in stored_image(data, "image/png", 3, 4, small)[1]) <= 64 * 1024


def test_content_pieces_put_each_image_in_its_place() -> None:
    image, _ = stored_image(b"\x01\x02", "image/gif", 1, 1)
    first, last = image.model_copy(update={"at": 0}), image.model_copy(update={"at": 7})
    middle = image.model_copy(update={"at": 5})
    message = ChatMessage(role="user", content="What is this?", images=[first, middle, last])
    assert content_pieces(message) == [first, "What ", middle, "is", last, " this?"]
    assert content_pieces(ChatMessage(role="user", content="hi")) == ["hi"]
    after = image.model_copy(update={"at": 2})
    assert content_pieces(ChatMessage(role="user", content="hi", images=[after])) == ["hi", after]


def test_a_message_of_an_old_log_has_no_images() -> None:
    old = json.loads('{"role": "user", "content": "hi", "tool_calls": []}')
    assert ChatMessage.model_validate(old).images == []


async def _messages(js: JetStreamContext) -> int:
    return (await js.stream_info(PARTS_STREAM)).state.messages


async def test_the_runner_reads_back_the_image_a_task_names(js: JetStreamContext) -> None:
    data = png(40, 30, pad=1_500_000)  # larger than one NATS message
    image, parts = stored_image(data, "image/png", 40, 30, piece_bytes(max_payload(js)))
    api = PartStore(js)
    await api.store(parts)
    stored = await _messages(js)
    assert stored == len(parts) >= 3
    await api.store(parts)  # the same image again: nothing new
    assert await _messages(js) == stored
    await PartStore(js).store(parts)  # another API process: the stream keeps one per digest
    assert await _messages(js) == stored

    message = ChatMessage(role="user", content="What is this?", images=[image])
    task = TaskCreated(
        task_id="t1",
        model_id="m",
        origin="test",
        kind="chat",
        messages=[message, message],
        params=SamplingParams(),
    )
    logged = await checked_in(api, task)
    assert logged.messages is None and len(logged.to_json()) < 2048  # no image inside

    runner = PartStore(js)
    whole = await resolved(runner, logged)
    assert whole.messages == [message, message]
    assert images_of(whole.messages) == [image]
    assert await image_bytes(runner, image) == data
    assert await task_images(runner, whole.messages) == {image.sha256: data}
    assert runner.cached_bytes < 64 * 1024  # an image's parts are not kept for the next turn


async def test_an_image_whose_parts_are_gone_or_not_its_bytes_is_said(
    js: JetStreamContext,
) -> None:
    store = PartStore(js)
    image, _ = stored_image(png(), "image/png", 2, 2)
    with pytest.raises(PartMissing, match="not stored"):
        await image_bytes(store, image)
    other, other_parts = stored_image(png(3, 3), "image/png", 3, 3)
    await store.store(other_parts)
    lying = ImagePart.model_validate(image.model_dump() | {"ref": other.ref})
    with pytest.raises(PartMissing, match="not its bytes"):
        await image_bytes(store, lying)
    assert await js.get_last_msg(PARTS_STREAM, part_subject(other.ref.digest))
