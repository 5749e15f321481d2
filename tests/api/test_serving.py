"""The streamed response's own behaviour, at the ASGI level (no server needed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest
from starlette.types import Message, Receive, Scope, Send

from api.errors import ApiError
from api.metrics import ApiMetrics, HttpMetrics
from api.openai.requests import ChatCompletionRequest
from api.serving import Refused, TaskEvents, failure_error, require_schemas
from events.catalogue import TaskCreated, TaskFailed
from events.records import ChatMessage, Tool


async def test_the_headers_go_out_with_the_first_event() -> None:
    happened: list[str] = []

    async def events() -> AsyncIterator[str]:
        for text in ("data: first\n\n", "data: second\n\n"):
            happened.append(f"made {text.split()[1]}")
            yield text

    async def send(message: Message) -> None:
        body = bytes(message.get("body", b"")).decode().strip()
        happened.append(f"sent {message['type'].rsplit('.', 1)[-1]} {body}".strip())

    response = TaskEvents([], events(), "text/event-stream", ApiMetrics())
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


def _too_long() -> ApiError:
    failed = TaskFailed(
        task_id="t",
        model_id="m",
        origin="r",
        error="invalid request: too long",
        prompt_tokens=40000,
        context_length=32768,
    )
    return failure_error(failed)


def test_a_prompt_too_long_is_said_in_each_dialect_s_words() -> None:
    err = _too_long()
    assert err.status == 400 and err.code == "context_length_exceeded"
    assert err.message_in("anthropic") == "prompt is too long: 40000 tokens > 32768 maximum"
    assert "maximum context length is 32768 tokens" in err.message_in("openai")


async def _answer(path: str, events: AsyncIterator[str], metrics: ApiMetrics) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError  # pragma: no cover

    scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await TaskEvents([], events, "text/event-stream", metrics)(scope, receive, send)
    return sent


async def test_tasks_failing_before_any_event_are_the_error_s_own_response() -> None:
    async def refused() -> AsyncIterator[str]:
        raise Refused(_too_long())
        yield ""  # pragma: no cover - a generator

    metrics = ApiMetrics()
    sent = await _answer("/v1/messages", refused(), metrics)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400
    body = json.loads(sent[1]["body"])
    assert body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 40000 tokens > 32768 maximum",
        },
    }
    counted = metrics.registry.get_sample_value(
        "shoal_http_requests_refused_total",
        {"endpoint": "other", "status": "400", "reason": "context_length_exceeded"},
    )
    assert counted == 1


async def test_a_client_that_leaves_before_the_response_starts_is_not_a_500() -> None:
    metrics = ApiMetrics()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the client is gone: the app gives up without answering

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:  # pragma: no cover - nothing is sent
        raise AssertionError(message)

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}
    await HttpMetrics(app, metrics)(scope, receive, send)
    labels = {"method": "POST", "endpoint": "other"}
    assert (
        metrics.registry.get_sample_value("shoal_http_requests_total", labels | {"status": "499"})
        == 1
    )
    assert (
        metrics.registry.get_sample_value("shoal_http_requests_total", labels | {"status": "500"})
        is None
    )
