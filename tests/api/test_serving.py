"""The streamed response's own behaviour, at the ASGI level (no server needed)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.types import Message

from api.serving import TaskEvents


async def test_the_headers_go_out_with_the_first_event() -> None:
    happened: list[str] = []

    async def events() -> AsyncIterator[str]:
        for text in ("data: first\n\n", "data: second\n\n"):
            happened.append(f"made {text.split()[1]}")
            yield text

    async def send(message: Message) -> None:
        body = bytes(message.get("body", b"")).decode().strip()
        happened.append(f"sent {message['type'].rsplit('.', 1)[-1]} {body}".strip())

    response = TaskEvents([], events(), "text/event-stream")
    await response.stream_response(send)

    assert happened == [
        "made first",
        "sent start",
        "sent body data: first",
        "made second",
        "sent body data: second",
        "sent body",
    ]
