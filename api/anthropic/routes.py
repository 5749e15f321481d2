"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(``GET /v1/models`` answers in Anthropic's shape to its SDK: see ``openai_routes``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse

from api.anthropic.messages import (
    COUNTING,
    MessagesBody,
    MessagesOut,
    MessagesRequest,
    TokenCountOut,
    task_for,
)
from api.context import ApiContext, context, require_key
from api.serving import serve

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


@router.post("/messages", response_model=None)
async def messages(body: MessagesRequest, ctx: Ctx) -> JSONResponse | StreamingResponse:
    return await serve_messages(ctx, body)


@router.post("/messages/count_tokens", response_model=None)
async def count_tokens(body: MessagesBody, ctx: Ctx) -> JSONResponse | StreamingResponse:
    """The prompt's tokens as the model reads them: its chat template, the system prompt and
    the tools as the runner renders them. The API has no tokenizer, so the count is made where
    the prompt is, by a task: a chat task generates at least one token (``max_tokens`` 0 is
    only for a completion that scores its prompt), so this one generates one, greedily, and
    its usage's prompt tokens are the answer."""
    model_id = await ctx.resolve_model(body.model)
    task = task_for(body, model_id, ctx.origin, COUNTING)
    return await serve(ctx, [task], False, TokenCountOut())


async def serve_messages(
    ctx: ApiContext, body: MessagesRequest
) -> JSONResponse | StreamingResponse:
    model_id = await ctx.resolve_model(body.model)
    task = task_for(body, model_id, ctx.origin, body.sampling())
    out = MessagesOut(f"msg_{task.task_id}", body.model, body.thinks)
    return await serve(ctx, [task], body.stream, out)
