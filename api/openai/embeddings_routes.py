"""``POST /v1/embeddings`` (OpenAI), and ``embed``, the one way every dialect computes
embeddings (Ollama's ``/api/embed`` calls it too): an ``EmbeddingsRequested`` task for the
model's embed instance, its vectors gathered from the log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from api.context import ApiContext, context, require_key
from api.embedding_task import gated
from api.errors import ApiError
from api.openai.embeddings import EmbeddingsRequest, embeddings_response
from api.serving import require_storable
from events.catalogue import EmbeddingsRequested, new_id
from events.vectors import Vectors

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


@dataclass(frozen=True)
class Embedded:
    """A request's vectors (one L2-normalised row per input, in order) and the tokens read."""

    array: Vectors
    prompt_tokens: int

    @property
    def vectors(self) -> list[list[float]]:
        out: list[list[float]] = self.array.tolist()
        return out


async def embed(
    ctx: ApiContext,
    model_id: str,
    inputs: list[str] | list[list[int]],
    dimensions: int | None = None,
    user: str | None = None,
    truncate: bool = False,
    keep_alive_s: float | None = None,
) -> Embedded:
    """The embeddings of ``inputs`` (texts, or token-id lists) by ``model_id``'s embed
    instance, each cut to ``dimensions`` and normalised again when given. A refusal raises
    ``ApiError``: 400 for an empty input, a model served for chat only (saying how to ask for
    an embed instance), an input longer than the instance's context (unless ``truncate``: then
    its end is cut off), or more dimensions than the model has; 404, 503, 413 or 504 as for
    any task. ``keep_alive_s``: Ollama's, for an embed instance loaded on demand."""
    if not inputs or any(not i for i in inputs):
        raise ApiError(
            400, "every input must be a non-empty text or list of token ids", param="input"
        )
    texts = [i for i in inputs if isinstance(i, str)]
    if texts and len(texts) != len(inputs):
        raise ApiError(400, "inputs are all texts or all token lists, not both", param="input")
    task = EmbeddingsRequested(
        task_id=new_id(),
        model_id=model_id,
        origin=ctx.origin,
        dimensions=dimensions,
        truncate=truncate,
        user=user,
        keep_alive_s=keep_alive_s,
        texts=texts or None,
        token_ids=None if texts else [list(i) for i in inputs if not isinstance(i, str)],
    )
    require_storable(ctx, task, "input", "Send fewer inputs.")
    vectors, done = await gated(ctx, task)
    return Embedded(vectors, done.usage.prompt_tokens)


@router.post("/embeddings")
async def embeddings(body: EmbeddingsRequest, ctx: Ctx) -> JSONResponse:
    return await serve_embeddings(ctx, body)


async def serve_embeddings(ctx: ApiContext, body: EmbeddingsRequest) -> JSONResponse:
    model_id = await ctx.resolve_model(body.model, "embed")
    done = await embed(ctx, model_id, body.inputs(), body.dimensions, body.user)
    return JSONResponse(
        embeddings_response(
            body.model or model_id, done.array, done.prompt_tokens, body.encoding_format
        )
    )
