"""``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``: llama.cpp's server's and
vLLM's endpoints at the API's root, as both serve them (``shapes.py``), answered by a runner of
the model (``asking.py``). Errors in OpenAI's shape, as both servers' clients read them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.context import ApiContext, context, require_key
from api.errors import ApiError
from api.images.loading import stored_images
from api.tokenizer.asking import ask
from api.tokenizer.shapes import (
    DetokenizeBody,
    LlamaTokenize,
    NoShape,
    VllmTokenizeChat,
    detokenized,
    invalid,
    tokenize_body,
    tokenized,
)
from events.tokenizer import DescribeTokenizer

router = APIRouter(dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


@router.post("/tokenize")
async def tokenize(body: Annotated[dict[str, Any], Body()], ctx: Ctx) -> dict[str, Any]:
    """A text's tokens (llama.cpp's ``content``, vLLM's ``prompt``), or a chat's prompt tokens
    through the model's chat template (vLLM's ``messages``)."""
    try:
        parsed = tokenize_body(body)
    except ValidationError as exc:
        raise RequestValidationError(invalid(exc)) from None
    except NoShape as exc:
        raise ApiError(400, str(exc), param="content") from None
    model_id = await ctx.resolve_model(parsed.model)
    if isinstance(parsed, VllmTokenizeChat):
        images = await stored_images(ctx, model_id, parsed.image_inputs())
        question = parsed.ask(model_id, ctx.origin, images)
        answer = await ask(ctx, model_id, question, "messages")
    else:
        param = "content" if isinstance(parsed, LlamaTokenize) else "prompt"
        answer = await ask(ctx, model_id, parsed.ask(), param)
    return tokenized(parsed, answer)


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, ctx: Ctx) -> dict[str, Any]:
    """Tokens back to text, special tokens spelled out."""
    model_id = await ctx.resolve_model(body.model)
    return detokenized(await ask(ctx, model_id, body.ask(), "tokens"))


@router.get("/tokenizer_info")
async def tokenizer_info(
    ctx: Ctx, model: Annotated[str | None, Query(min_length=1)] = None
) -> dict[str, Any]:
    """The tokenizer's settings, as vLLM's (its class, special tokens, ``model_max_length``,
    the chat template)."""
    model_id = await ctx.resolve_model(model)
    return (await ask(ctx, model_id, DescribeTokenizer())).info or {}
