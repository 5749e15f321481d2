"""Images through a real `shoal api` (nats-server, projector, API processes), with each
dialect's own SDK: a 20 MB image is a 413, a corrupt one a 400, an image URL a 400 unless the
API fetches them, and an image for a model that reads text only a 400 that says so, each in
the client's own error shape. (No model reads images yet: issue 36's engine step.)"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import ollama
import openai
import pytest

from harness.images import b64, data_url, png
from tests.api.conftest import ApiStack

HUGE = png(4, 4, pad=20_000_000)  # 20 MB: more than the 10 MiB an image may be
CORRUPT = b"\x89PNG\r\n\x1a\n but not one"


async def _status(call: Callable[[], Awaitable[Any]]) -> tuple[int, str]:
    """The status and message of the error ``call`` raises, as its SDK raises it."""
    try:
        await call()
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return exc.status_code, exc.message
    except ollama.ResponseError as exc:
        return exc.status_code, exc.error
    raise AssertionError("no error")


def _openai_content(url: str) -> list[Any]:
    return [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]


async def test_each_dialect_refuses_what_it_cannot_take_in_its_own_shape(
    api_stack: ApiStack,
) -> None:
    oa = openai.AsyncOpenAI(base_url=f"{api_stack.url}/v1", api_key="x", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=api_stack.url, api_key="x", max_retries=0)
    ol = ollama.AsyncClient(host=api_stack.url)

    def chat(url: str) -> Callable[[], Awaitable[Any]]:
        content = _openai_content(url)
        return lambda: oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}]
        )

    def responses(url: str) -> Callable[[], Awaitable[Any]]:
        part: Any = {"type": "input_image", "image_url": url, "detail": "auto"}
        return lambda: oa.responses.create(model="m", input=[{"role": "user", "content": [part]}])

    def messages(data: bytes) -> Callable[[], Awaitable[Any]]:
        source: Any = {"type": "base64", "media_type": "image/png", "data": b64(data)}
        block: Any = {"type": "image", "source": source}
        return lambda: an.messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": [block]}]
        )

    def ollama_chat(data: bytes) -> Callable[[], Awaitable[Any]]:
        message = {"role": "user", "content": "What is this?", "images": [data]}
        return lambda: ol.chat(model="m", messages=[message])

    def ollama_generate(data: bytes) -> Callable[[], Awaitable[Any]]:
        return lambda: ol.generate(model="m", prompt="What is this?", images=[data])

    calls: dict[str, Callable[[bytes], Callable[[], Awaitable[Any]]]] = {
        "openai": lambda data: chat(data_url(data)),
        "responses": lambda data: responses(data_url(data)),
        "anthropic": messages,
        "ollama-chat": ollama_chat,
        "ollama-generate": ollama_generate,
    }
    for dialect, call in calls.items():
        status, message = await _status(call(HUGE))
        assert status == 413 and "more than the 10485760 bytes" in message, (dialect, message)
        status, message = await _status(call(CORRUPT))
        assert status == 400 and "the image cannot be read" in message, (dialect, message)
        status, message = await _status(call(png()))
        assert status == 400 and "model m does not accept images" in message, (dialect, message)

    url = "http://127.0.0.1:9/a.png"
    for refused in (chat(url), responses(url)):
        status, message = await _status(refused)
        assert status == 400 and "does not fetch image URLs" in message
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(data_url(CORRUPT))()
    assert caught.value.param == "messages.0.content.1"
    with pytest.raises(anthropic.RequestTooLargeError) as too_large:
        await messages(HUGE)()
    body: Any = too_large.value.body
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    assert body["error"]["message"].startswith("messages.0.content.0: the image is 20000085")
    await oa.close()
    await an.close()
