"""Images in every dialect, as each SDK's own types send them, become one shape: the same
image record (the same digest, the same stored parts) in the task's message, whichever dialect
sent it and however; and what cannot be taken is refused the same way, naming the field in
the dialect's terms. Translation is pure; storage is on a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ollama
import pytest
from anthropic.types import MessageParam
from nats.js import JetStreamContext
from ollama._types import ChatRequest as OllamaChat
from ollama._types import GenerateRequest as OllamaGenerate
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputParam
from pydantic import ValidationError

from api.anthropic.messages import MessagesRequest, task_for
from api.errors import ApiError
from api.images.fetching import IpAddress
from api.images.inputs import ImageInput
from api.images.loading import ImagePolicy, read_images
from api.images.placed import Images
from api.ollama.translate import ChatRequest, GenerateRequest
from api.openai.requests import ChatCompletionRequest
from api.responses.requests import ResponsesRequest, input_items
from bus.stores.images import image_bytes, stored_image
from bus.stores.parts import PARTS_STREAM, PartStore
from events.records import ChatMessage, ImagePart, SamplingParams
from harness.images import b64, data_url, jpeg, png

PNG = png(16, 9, colour=7)
ASK = "What is this?"
TAKES = ImagePolicy(accepts=True)
# 20 MB: more than the 10 MiB an image may be by default.
HUGE = png(4, 4, pad=20_000_000)


def openai_body(image: str = data_url(PNG)) -> ChatCompletionRequest:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": ASK},
                {"type": "image_url", "image_url": {"url": image, "detail": "low"}},
            ],
        },
    ]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def responses_body(image: str = data_url(PNG)) -> ResponsesRequest:
    items: ResponseInputParam = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": ASK},
                {"type": "input_image", "image_url": image, "detail": "auto"},
            ],
        }
    ]
    return ResponsesRequest.model_validate({"model": "m", "input": items})


def anthropic_body(data: str = b64(PNG), url: str | None = None) -> MessagesRequest:
    source: Any = (
        {"type": "url", "url": url}
        if url is not None
        else {"type": "base64", "media_type": "image/png", "data": data}
    )
    messages: list[MessageParam] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": ASK}, {"type": "image", "source": source}],
        }
    ]
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": messages})


def ollama_chat(image: bytes | str = PNG) -> ChatRequest:
    sent = OllamaChat(
        model="m",
        messages=[ollama.Message(role="user", content=ASK, images=[ollama.Image(value=image)])],
    )
    return ChatRequest.model_validate(sent.model_dump(exclude_none=True))


def ollama_generate(image: bytes | str = PNG) -> GenerateRequest:
    sent = OllamaGenerate(model="m", prompt=ASK, images=[ollama.Image(value=image)])
    return GenerateRequest.model_validate(sent.model_dump(exclude_none=True))


async def _translated(
    dialect: str, policy: ImagePolicy = TAKES
) -> tuple[list[ChatMessage], Images]:
    """The task messages of the same image sent in ``dialect``, and the images read."""
    if dialect == "openai":
        chat = openai_body()
        images = await read_images(chat.image_inputs(), "m", policy)
        return chat.chat_messages(images), images
    if dialect == "responses":
        resp = responses_body()
        images = await read_images(resp.image_inputs(), "m", policy)
        return resp.input_messages(images), images
    if dialect == "anthropic":
        body = anthropic_body()
        images = await read_images(body.image_inputs(), "m", policy)
        return task_for(body, "m", "api", SamplingParams(), images).messages or [], images
    if dialect == "ollama-chat":
        ochat = ollama_chat()
        images = await read_images(ochat.image_inputs(), "m", policy)
        return ochat.task_fields(images)["messages"], images
    gen = ollama_generate()
    images = await read_images(gen.image_inputs(), "m", policy)
    return gen.task_fields(images)["messages"], images


DIALECTS = ["openai", "responses", "anthropic", "ollama-chat", "ollama-generate"]


async def test_every_dialects_image_is_the_same_stored_image() -> None:
    expected, parts = stored_image(PNG, "image/png", 16, 9)
    seen: dict[str, ImagePart] = {}
    for dialect in DIALECTS:
        messages, images = await _translated(dialect)
        user = next(m for m in messages if m.role == "user")
        assert user.content == ASK
        [image] = user.images
        # The text comes first in OpenAI's and Anthropic's shapes; Ollama's images go first.
        assert image.at == (0 if dialect.startswith("ollama") else len(ASK)), dialect
        seen[dialect] = image.model_copy(update={"at": 0})
        assert [p.digest for p in images.parts] == [p.digest for p in parts], dialect
    assert all(image == expected for image in seen.values()), seen


async def test_an_image_sent_twice_is_read_once() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}]}
                for u in (data_url(PNG), data_url(PNG), data_url(png(2, 2)))
            ],
        }
    )
    images = await read_images(body.image_inputs(), "m", TAKES)
    assert len(images.records) == 2 and len(images.parts) == 2
    messages = body.chat_messages(images)
    assert messages[0].images == messages[1].images != messages[2].images


def test_images_go_where_they_were_sent_among_the_text() -> None:
    record, _ = stored_image(PNG, "image/png", 16, 9)
    one, two = ImageInput(base64="one"), ImageInput(base64="two")
    images = Images({"one": record, "two": record.model_copy(update={"sha256": "0" * 64})})
    text, placed = images.placed([one, "Compare ", two, " with", " this."])
    assert text == "Compare  with this."
    assert [(i.at, i.sha256[0]) for i in placed] == [(0, record.sha256[0]), (8, "0")]


async def test_an_anthropic_tool_result_may_hold_an_image() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "Take a screenshot."},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "c1", "name": "shot", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "c1",
                            "is_error": True,
                            "content": [
                                {"type": "text", "text": "blurred"},
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/jpeg",
                                        "data": b64(jpeg(30, 20)),
                                    },
                                },
                            ],
                        },
                        {"type": "text", "text": "What went wrong?"},
                    ],
                },
            ],
        }
    )
    [given] = body.image_inputs()
    assert given.where == "messages.2.content.0.content.1"
    images = await read_images([given], "m", TAKES)
    tool, user = body.chat_messages(images)[2:]
    assert tool.role == "tool" and tool.content == "Error: blurred" and user.images == []
    [image] = tool.images
    assert (image.media_type, image.width, image.height, image.at) == ("image/jpeg", 30, 20, 14)


def test_a_stored_responses_input_lists_its_image_without_its_bytes() -> None:
    body = responses_body()
    [item] = input_items(body.input, "t1")
    assert item["content"] == [
        {"type": "input_text", "text": ASK},
        {"type": "input_image", "image_url": None, "file_id": None, "detail": "auto"},
    ]
    url = "https://example.com/a.png"
    [linked] = input_items(responses_body(url).input, "t1")
    assert linked["content"][1]["image_url"] == url


# --- refusals --------------------------------------------------------------------------------


def _bodies(image: bytes) -> dict[str, tuple[Sequence[ImageInput], str]]:
    """The inputs of ``image`` sent in each dialect, and the field each names."""
    return {
        "openai": (openai_body(data_url(image)).image_inputs(), "messages.1.content.1"),
        "responses": (responses_body(data_url(image)).image_inputs(), "input.0.content.1"),
        "anthropic": (anthropic_body(b64(image)).image_inputs(), "messages.0.content.1"),
        "ollama-chat": (ollama_chat(image).image_inputs(), "messages.0.images.0"),
        "ollama-generate": (ollama_generate(image).image_inputs(), "images.0"),
    }


@pytest.mark.parametrize(
    ("image", "policy", "status", "says"),
    [
        (HUGE, TAKES, 413, "more than the 10485760 bytes (10 MiB)"),
        (b"%PDF-1.7 not an image", TAKES, 400, "not a PNG, JPEG, WebP or GIF"),
        (PNG[:60], TAKES, 400, "the PNG is cut short"),
        (png(10_000, 10_000), TAKES, 413, "10000x10000 pixels"),
        (PNG, ImagePolicy(accepts=False), 400, "model m does not accept images"),
        (PNG, ImagePolicy(accepts=False, engine="mlx"), 400, "MLX weights hold no vision tower"),
    ],
    ids=["20MB", "not-an-image", "truncated", "too-many-pixels", "text-model", "mlx-model"],
)
async def test_what_cannot_be_taken_is_refused_naming_the_field(
    image: bytes, policy: ImagePolicy, status: int, says: str
) -> None:
    for dialect, (inputs, where) in _bodies(image).items():
        with pytest.raises(ApiError) as caught:
            await read_images(inputs, "m", policy)
        assert (caught.value.status, caught.value.param) == (status, where), dialect
        assert says in caught.value.message, (dialect, caught.value.message)


async def test_an_image_url_is_fetched_only_when_allowed_and_only_from_public_addresses() -> None:
    for inputs in (
        openai_body("https://example.com/a.png").image_inputs(),
        anthropic_body(url="https://example.com/a.png").image_inputs(),
    ):
        with pytest.raises(ApiError, match="does not fetch image URLs") as caught:
            await read_images(inputs, "m", TAKES)
        assert caught.value.status == 400
    fetching = ImagePolicy(accepts=True, allow_urls=True)
    for url in (
        "http://127.0.0.1/a.png",
        "http://10.0.0.7/a.png",
        "http://169.254.169.254/",
        "http://[::1]/a.png",
        "http://localhost/a.png",
    ):
        with pytest.raises(ApiError, match="not a public address"):
            await read_images(responses_body(url).image_inputs(), "m", fetching)
    # A text model is refused before anything is fetched.
    with pytest.raises(ApiError, match="does not accept images"):
        await read_images(
            openai_body("http://127.0.0.1/a.png").image_inputs(),
            "m",
            ImagePolicy(allow_urls=True),
        )


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: image/png\r\n\r\n" + PNG)
        await writer.drain()
        writer.close()

    listening = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with listening:
        yield f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}/a.png"


async def test_an_image_fetched_by_url_is_the_image_sent_as_data(image_server: str) -> None:
    def loopback(ip: IpAddress) -> bool:
        return ip.is_loopback

    policy = ImagePolicy(accepts=True, allow_urls=True, allowed=loopback)
    expected, _ = stored_image(PNG, "image/png", 16, 9)
    for inputs in (
        openai_body(image_server).image_inputs(),
        responses_body(image_server).image_inputs(),
        anthropic_body(url=image_server).image_inputs(),
    ):
        images = await read_images(inputs, "m", policy)
        assert list(images.records.values()) == [expected]


def test_malformed_images_are_a_400_at_validation() -> None:
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: openai_body("ftp://example.com/a.png"), r"content\[1\]: an image URL is"),
        (lambda: responses_body("data:image/png,raw"), "not base64"),
        (lambda: anthropic_body(url="file:///etc/passwd"), "an image URL is"),
        (
            lambda: ChatCompletionRequest.model_validate(
                {
                    "model": "m",
                    "messages": [
                        {
                            "role": "assistant",
                            "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}],
                        }
                    ],
                }
            ),
            "only a user message may hold an image",
        ),
        (
            lambda: ChatCompletionRequest.model_validate(
                {
                    "model": "m",
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "input_audio", "input_audio": {"data": ""}}],
                        }
                    ],
                }
            ),
            "audio",
        ),
        (
            lambda: GenerateRequest.model_validate(
                {"model": "m", "prompt": "x", "raw": True, "images": [b64(PNG)]}
            ),
            "images with raw",
        ),
    ]
    for build, says in cases:
        with pytest.raises(ValidationError, match=says):
            build()


# --- storage ---------------------------------------------------------------------------------


async def test_the_images_of_every_dialect_are_stored_once(js: JetStreamContext) -> None:
    store = PartStore(js)
    counts = []
    for dialect in DIALECTS:
        messages, images = await _translated(dialect)
        await PartStore(js).store(images.parts)  # each request as another API process would
        counts.append((await js.stream_info(PARTS_STREAM)).state.messages)
        [image] = next(m for m in messages if m.role == "user").images
        assert await image_bytes(store, image) == PNG
    assert counts == [counts[0]] * len(DIALECTS) and counts[0] == 1
