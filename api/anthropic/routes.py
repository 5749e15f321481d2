"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(``GET /v1/models`` answers in Anthropic's shape to its SDK: see ``openai_routes``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse

from api.anthropic.messages import MessagesBody, MessagesOut, MessagesRequest, task_for
from api.context import ApiContext, context, require_key
from api.images.loading import request_images, stored_images
from api.serving import serve
from api.tokenizer.asking import ask
from events.records import SamplingParams
from events.tokenizer import TokenizeChat

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


@router.post("/messages", response_model=None)
async def messages(body: MessagesRequest, ctx: Ctx) -> JSONResponse | StreamingResponse:
    return await serve_messages(ctx, body)


@router.post("/messages/count_tokens")
async def count_tokens(body: MessagesBody, ctx: Ctx) -> dict[str, int]:
    """The prompt's tokens as the model reads them: its chat template, the system prompt and
    the tools as the runner renders them for a message of the same body, counted by a runner
    of the model without generating (``api/tokenizer/asking.py``): the API has no
    tokenizer."""
    model_id = await ctx.resolve_model(body.model)
    images = await stored_images(ctx, model_id, body.image_inputs())
    task = task_for(body, model_id, ctx.origin, SamplingParams(), images)
    counted = await ask(ctx, model_id, TokenizeChat(task=task, count_only=True), "messages")
    return {"input_tokens": counted.count}


async def serve_messages(
    ctx: ApiContext, body: MessagesRequest
) -> JSONResponse | StreamingResponse:
    model_id = await ctx.resolve_model(body.model)
    images = await request_images(ctx, model_id, body.image_inputs())
    task = task_for(body, model_id, ctx.origin, body.sampling(), images)
    out = MessagesOut(f"msg_{task.task_id}", body.model, body.thinks, body.thinking_shown)
    return await serve(ctx, [task], body.stream, out, images)
