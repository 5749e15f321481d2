"""The fast lane, at the ASGI level against a real nats-server and database: what it answers
itself, and what it hands on to FastAPI, body intact."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import Message, Receive, Scope, Send

from api.config import ApiConfig
from api.context import ApiContext
from api.fast_lane import FastLane, _is_json
from api.metrics import ApiMetrics
from api.serving_verdicts import ServingVerdicts
from projectors import database

CHAT = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class FastApiStandIn:
    """Where the fast lane hands a request on: records it, with the body it can read."""

    calls: list[tuple[str, bytes]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.calls.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@dataclass
class Answer:
    status: int
    body: dict[str, Any] | None


async def call(
    lane: FastLane, ctx: ApiContext, path: str, chunks: list[bytes], **headers: str
) -> Answer:
    scope = {
        "type": "http", "method": "POST", "path": path, "app": SimpleNamespace(
            state=SimpleNamespace(ctx=ctx), routes=[]),
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    incoming: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await lane(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return Answer(sent[0]["status"], json.loads(body) if body else None)


@pytest.fixture
async def context(nc: Client, engine: AsyncEngine, db_url: str) -> AsyncIterator[ApiContext]:
    await database.upgrade(engine)
    config = ApiConfig("unused", db_url, api_keys=frozenset({"sesame"}))
    yield ApiContext(config, nc, engine, ApiMetrics(), ServingVerdicts(1.0))


async def test_a_valid_request_is_answered_without_fastapi(context: ApiContext) -> None:
    fastapi = FastApiStandIn()
    lane = FastLane(fastapi)
    body = json.dumps(CHAT).encode()
    # In two parts, as a client may send it; the model is unknown: the 404 FastAPI would give.
    answer = await call(lane, context, "/v1/chat/completions", [body[:10], body[10:]],
                        content_type="application/json", authorization="Bearer sesame")  # fmt: skip
    assert answer.status == 404 and answer.body is not None
    assert answer.body["error"]["code"] == "model_not_found"
    completion = json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()
    answer = await call(lane, context, "/v1/completions", [completion],
                        authorization="Bearer sesame")  # fmt: skip
    assert answer.status == 404
    # A missing or wrong key: the 401 of every other endpoint, before the body is looked at.
    for headers in ({}, {"authorization": "Bearer nope"}):
        answer = await call(lane, context, "/v1/chat/completions", [b"{"], **headers)
        assert answer.status == 401 and answer.body is not None
        assert answer.body["error"]["code"] == "invalid_api_key"
    assert fastapi.calls == []


@pytest.mark.parametrize(
    ("path", "body", "content_type"),
    [
        ("/v1/chat/completions", b"this is not json", "application/json"),
        ("/v1/chat/completions", b'{"model": "m", "messages": []}', "application/json"),
        ("/v1/chat/completions", b"", "application/json"),
        ("/v1/chat/completions", json.dumps(CHAT).encode(), "text/plain"),
        ("/v1/completions", json.dumps(CHAT).encode(), "application/json"),  # no prompt
        ("/v1/instances", json.dumps(CHAT).encode(), "application/json"),
    ],
    ids=["not-json", "invalid", "empty", "text-plain", "wrong-shape", "other-path"],
)
async def test_anything_else_goes_on_to_fastapi_with_its_body(
    context: ApiContext, path: str, body: bytes, content_type: str
) -> None:
    fastapi = FastApiStandIn()
    answer = await call(FastLane(fastapi), context, path, [body[:3], body[3:]],
                        content_type=content_type, authorization="Bearer sesame")  # fmt: skip
    assert answer.status == 299
    assert fastapi.calls == [(path, body)]


@pytest.mark.parametrize(
    ("content_type", "json_"),
    [
        (None, True),
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/merge-patch+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("json", False),
    ],
)
def test_json_content_types_as_fastapi_reads_them(content_type: str | None, json_: bool) -> None:
    assert _is_json(content_type) is json_
