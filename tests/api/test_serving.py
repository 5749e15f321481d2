"""The streamed response's own behaviour, at the ASGI level (no server needed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest
from starlette.types import Message

from api.errors import ApiError
from api.openai.requests import ChatCompletionRequest
from api.serving import TaskEvents, require_schemas
from bus.events import TaskCreated
from bus.records import ChatMessage, Tool


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


def _tool(i: int, n: int) -> dict[str, Any]:
    properties = {f"p{j}": {"type": "string"} for j in range(n)}
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}


def test_schema_bombs_are_a_400_naming_the_field() -> None:
    """Once, tools of 600-800 optional properties reached a runner and froze its loop."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate(body | {"tools": [_tool(0, 1), _tool(1, 300)]})
    error = caught.value.errors()[0]
    assert error["loc"][:2] == ("tools", 1) and "more than the 256" in error["msg"]
    tools = [
        Tool(name=f"f{i}", parameters=_tool(i, 250)["function"]["parameters"]) for i in range(9)
    ]
    task = TaskCreated(
        task_id="t", model_id="m", origin="t", messages=[ChatMessage(role="user", content="x")]
    )
    require_schemas(task.model_copy(update={"tools": tools[:8]}))
    with pytest.raises(ApiError) as refused:
        require_schemas(task.model_copy(update={"tools": tools}))
    assert refused.value.status == 400 and refused.value.param == "tools.8.parameters"
