"""``POST /v1/rerank`` and ``POST /rerank`` (llama.cpp's server, vLLM, Jina and Cohere clients
call one or the other): an ``EmbeddingsRequested`` task with the query, for the model's rerank
instance (loaded on demand as embeddings' are), its scores gathered from the log as
embeddings' vectors are."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from api.context import ApiContext, context, require_key
from api.embedding_task import gated
from api.rerank.translate import RerankRequest, rerank_response
from api.serving import require_storable
from events.catalogue import EmbeddingsRequested, new_id

router = APIRouter(dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, ctx: Ctx) -> JSONResponse:
    model_id = await ctx.resolve_model(body.model, "rerank")
    texts = body.texts()
    task = EmbeddingsRequested(
        task_id=new_id(),
        model_id=model_id,
        origin=ctx.origin,
        query=body.query,
        texts=texts,
        user=body.user,
    )
    require_storable(ctx, task, "documents", "Send fewer or shorter documents.")
    scores, done = await gated(ctx, task)
    return JSONResponse(
        rerank_response(
            f"rerank-{task.task_id}",
            body.model or model_id,
            texts,
            scores,
            done.usage.prompt_tokens,
            body.top_n,
            body.return_documents,
        )
    )
