"""The requests that carry a model's work, answered before FastAPI's per-request machinery.

A ``POST`` to one of ``LANES``' paths (each dialect's generation endpoints) whose JSON body
validates is served here: the same key rule (``context.key_refusal``), the same pydantic model,
the same serve function as its FastAPI route. FastAPI's routing, dependency solving and
body parsing are paid out of each request's time to first token (docs/api.md says how much);
read here, the body costs a pydantic ``model_validate_json``.

Everything else goes on to FastAPI unchanged, the body read here replayed: other paths, a body
that is not JSON or does not validate (FastAPI makes the 400 that names the field, errors.py),
other content types. The OpenAPI document still describes both endpoints from their FastAPI
routes, which also serve what comes past this lane.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import admission
from api.anthropic import MessagesRequest
from api.anthropic_routes import serve_messages
from api.context import ApiContext, given_key, key_refusal
from api.embeddings import EmbeddingsRequest
from api.embeddings_routes import serve_embeddings
from api.errors import ApiError, dialect_of, error_response
from api.ollama import ChatRequest as OllamaChatRequest
from api.ollama import EmbedRequest as OllamaEmbedRequest
from api.ollama import GenerateRequest as OllamaGenerateRequest
from api.ollama_routes import serve_chat as serve_ollama_chat
from api.ollama_routes import serve_embed as serve_ollama_embed
from api.ollama_routes import serve_generate as serve_ollama_generate
from api.openai_routes import serve_chat, serve_completion
from api.responses import ResponsesRequest
from api.responses_routes import serve_responses
from api.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class Lane:
    body: type[BaseModel]
    serve: Callable[[ApiContext, Any], Awaitable[Response]]


LANES: dict[str, Lane] = {
    "/v1/chat/completions": Lane(ChatCompletionRequest, serve_chat),
    "/v1/completions": Lane(CompletionRequest, serve_completion),
    "/v1/embeddings": Lane(EmbeddingsRequest, serve_embeddings),
    "/v1/messages": Lane(MessagesRequest, serve_messages),
    "/v1/responses": Lane(ResponsesRequest, serve_responses),
    "/api/chat": Lane(OllamaChatRequest, serve_ollama_chat),
    "/api/generate": Lane(OllamaGenerateRequest, serve_ollama_generate),
    "/api/embed": Lane(OllamaEmbedRequest, serve_ollama_embed),
}


@dataclass(frozen=True)
class LaneRoute:
    """In the scope, where FastAPI puts the route it chose: the metrics label by its path."""

    path: str


class FastLane:
    """ASGI middleware; sits inside the metrics middleware, which counts what it answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        lane = LANES.get(path)
        if lane is None or scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if not _is_json(headers.get("content-type")):
            await self.app(scope, receive, send)
            return
        ctx: ApiContext = scope["app"].state.ctx
        scope["route"] = LaneRoute(path)  # for the metrics' route label
        dialect = dialect_of(path)
        authorization, x_api_key = headers.get("authorization"), headers.get("x-api-key")
        refused = key_refusal(ctx.config.api_keys, authorization, x_api_key)
        if refused is not None:
            await error_response(refused, dialect)(scope, receive, send)
            return
        admission.note_caller(given_key(authorization, x_api_key), receive)  # as require_key
        messages, body = await _read_body(receive)
        try:
            request = lane.body.model_validate_json(body) if body else None
        except ValidationError:
            request = None
        if request is None:  # FastAPI says what is wrong with it
            await self.app(scope, _replay(messages, receive), send)
            return
        try:
            response = await lane.serve(ctx, request)
        except ApiError as err:
            response = error_response(err, dialect)
        await response(scope, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    wanted = (b"content-type", b"authorization", b"x-api-key")
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in wanted}


def _is_json(content_type: str | None) -> bool:
    """As FastAPI reads a body as JSON: no content type, ``application/json`` or ``+json``."""
    if content_type is None:
        return True
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def _read_body(receive: Receive) -> tuple[list[Message], bytes]:
    """The request's messages as received (for a replay) and its body; the body stops short
    if the client went away."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    complete = messages[-1]["type"] == "http.request"
    return messages, b"".join(m.get("body", b"") for m in messages) if complete else b""


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
