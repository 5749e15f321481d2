"""Ollama's API at ``/api/...``: ``ollama.Client(host=...)`` and Open WebUI's Ollama connection
work unchanged. Generation goes through the one serving path (``api/serving.py``); models are
Shoal's (``shoal models add``), so what would build or upload a model is a 501."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api import keys, on_demand, projection
from api.context import ApiContext, context, require_key
from api.errors import ApiError
from api.images.loading import request_images
from api.model_list import askable
from api.ollama.models import digest, listed, running, serving_instance, show
from api.ollama.pull import live_instance, placement_refusal, pull_lines
from api.ollama.replies import OllamaOut, embedded, loaded
from api.ollama.translate import (
    VERSION,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    NamedRequest,
    keep_alive_s,
)
from api.openai.embeddings_routes import embed
from api.serving import checked, ndjson, serve
from api.thinking import shown
from events.catalogue import InstanceDeleteRequested, TaskCreated, new_id
from services.models.catalogue import builtin_cards
from services.models.remove import ModelInUse, ModelNotKnown, live_instances, remove_model
from services.planner.on_demand import expires_at

router = APIRouter(dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]

NDJSON = "application/x-ndjson"
_GONE = ("deleting", "deleted")


def _not_found(name: str) -> ApiError:
    # Ollama's own words, which some clients look for.
    return ApiError(404, f"model '{name}' not found", param="model", code="model_not_found")


# --- generation -----------------------------------------------------------------------------


@router.post("/api/chat", response_model=None)
async def chat(body: ChatRequest, ctx: Ctx) -> Response:
    return await serve_chat(ctx, body)


@router.post("/api/generate", response_model=None)
async def generate(body: GenerateRequest, ctx: Ctx) -> Response:
    return await serve_generate(ctx, body)


async def serve_chat(ctx: ApiContext, body: ChatRequest) -> Response:
    model_id = await ctx.resolve_model(body.model)
    name = body.model or model_id
    if not body.messages:
        return await _loaded(ctx, model_id, name, body, chat=True)
    images = await request_images(ctx, model_id, body.image_inputs())
    fields = body.task_fields(images)
    task = TaskCreated(task_id=new_id(), model_id=model_id, origin=ctx.origin, **fields)
    out = OllamaOut(name, True, bool(body.logprobs), shown(task.thinking))
    return await serve(ctx, [task], body.stream, out, images)


async def serve_generate(ctx: ApiContext, body: GenerateRequest) -> Response:
    model_id = await ctx.resolve_model(body.model)
    name = body.model or model_id
    if not body.prompt and not body.images:
        return await _loaded(ctx, model_id, name, body, chat=False)
    images = await request_images(ctx, model_id, body.image_inputs())
    fields = body.task_fields(images)
    task = TaskCreated(task_id=new_id(), model_id=model_id, origin=ctx.origin, **fields)
    out = OllamaOut(name, False, bool(body.logprobs), shown(task.thinking))
    return await serve(ctx, [task], body.stream, out, images)


@router.post("/api/embed", response_model=None)
async def embed_route(body: EmbedRequest, ctx: Ctx) -> Response:
    return await serve_embed(ctx, body)


async def serve_embed(ctx: ApiContext, body: EmbedRequest) -> Response:
    model_id = await ctx.resolve_model(body.model, "embed")
    started = time.monotonic()
    inputs = body.inputs()
    keep = keep_alive_s(body.keep_alive)
    if not inputs:  # Ollama loads the model
        await checked(ctx, model_id, "embed", keep)
        return JSONResponse({"model": body.model or model_id, "embeddings": []})
    done = await embed(ctx, model_id, list(inputs), body.dimensions, keep_alive_s=keep)
    wall_s = time.monotonic() - started
    return JSONResponse(embedded(body.model or model_id, done.vectors, done.prompt_tokens, wall_s))


@router.post("/api/embeddings")
async def embeddings(body: EmbeddingsRequest, ctx: Ctx) -> dict[str, Any]:
    """The older endpoint: one prompt, one vector (none for an empty prompt)."""
    model_id = await ctx.resolve_model(body.model, "embed")
    keep = keep_alive_s(body.keep_alive)
    if not body.prompt:
        await checked(ctx, model_id, "embed", keep)
        return {"embedding": []}
    done = await embed(ctx, model_id, [body.prompt], keep_alive_s=keep)
    return {"embedding": done.vectors[0]}


async def _loaded(
    ctx: ApiContext, model_id: str, name: str, request: ChatRequest | GenerateRequest, chat: bool
) -> Response:
    """Ollama's way to load a model: a request with nothing to answer (loaded on demand if
    nothing serves it, else the 404 or 503 that says why not); with ``keep_alive: 0``, to
    unload it: its instances loaded on demand are deleted (pinned ones stay)."""
    keep = request.keep_alive_s()
    if keep == 0:
        if not on_demand.may_change_the_cluster(ctx.config):  # other keys may be streaming from it
            raise on_demand.admin_only("Unloading (keep_alive 0) model", model_id)
        state = await projection.cluster(ctx.engine)
        for inst in on_demand.unloadable(state, model_id):
            reason = f"unloaded: keep_alive 0 ({'/api/chat' if chat else '/api/generate'})"
            await ctx.publish(
                InstanceDeleteRequested(
                    instance_id=inst.instance_id, origin=ctx.origin, reason=reason
                )
            )
        body = loaded(name, chat, reason="unload")
    else:
        await checked(ctx, model_id, keep_alive_s=keep)
        body = loaded(name, chat)
    return Response(ndjson(body), media_type=NDJSON) if request.stream else JSONResponse(body)


# --- models ---------------------------------------------------------------------------------


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/api/tags")
async def tags(ctx: Ctx) -> dict[str, Any]:
    """Every model a client can ask for, as ``name:tag`` (api/model_list.py): those the cluster
    knows and their aliases, then the catalogue's cards not added yet (that the key may
    download)."""
    state = await projection.cluster(ctx.engine)
    names = ctx.names_in(state)
    cards = on_demand.downloadable(ctx.config)  # a user key's: only what is added
    return {"models": [listed(entry) for entry in askable(state, names, cards)]}


@router.get("/api/ps")
async def ps(ctx: Ctx) -> dict[str, Any]:
    """The models (and aliases) with an instance that serves now."""
    state = await projection.cluster(ctx.engine)
    names = await ctx.model_names()
    models = []
    for name, model_id in names.listed():
        model = state.model(model_id)
        inst = serving_instance(state, model_id)
        if model is not None and inst is not None:
            runners = list(state.runners_of(inst.instance_id))
            expiry = expires_at(inst, ctx.config.default_keep_alive_s)
            models.append(running(name, model, inst, runners, expiry))
    return {"models": models}


@router.post("/api/show")
async def show_model(body: NamedRequest, ctx: Ctx) -> dict[str, Any]:
    model_id = await ctx.resolve_model(body.given)
    state = await projection.cluster(ctx.engine)
    model = state.model(model_id)
    if model is None:
        raise _not_found(body.given)
    live = [i for i in state.instances() if i.model_id == model_id and i.status not in _GONE]
    # A chat instance's context first: an embed instance's is often shorter.
    chat_first = sorted(live, key=lambda i: i.role != "chat")
    context_length = next(
        (i.context_length for i in chat_first if i.context_length), model.context_length
    )
    # A filesystem path tells a user key about the node's disks: an admin's only.
    return show(model, context_length, {i.role for i in live}, keys.current().role == "admin")


@router.delete("/api/delete")  # what Ollama's clients send
@router.post("/api/delete")
async def delete(body: NamedRequest, ctx: Ctx) -> dict[str, Any]:
    """Ollama removes a model from disk, and so does Shoal: every live instance of it is deleted
    (``InstanceDeleteRequested``), then the model is removed (``ModelRemoved``: the bucket's
    objects no other model names go, and each node's cache drops its files). A pull adds it
    again. 404 for a model the cluster does not know; 409 when an instance of it was asked for
    meanwhile."""
    model_id = await ctx.resolve_model(body.given)
    state = await projection.cluster(ctx.engine)
    live = live_instances(state, model_id)
    if not live and state.model(model_id) is None:
        raise _not_found(body.given)
    for instance_id in live:
        await ctx.publish(
            InstanceDeleteRequested(
                instance_id=instance_id, origin=ctx.origin, reason="DELETE /api/delete"
            )
        )
    try:
        removal = await remove_model(
            ctx.nc.jetstream(),
            state,
            model_id,
            origin=ctx.origin,
            reason="DELETE /api/delete",
            deleting=live,
        )
    except ModelNotKnown:
        if not live:
            raise _not_found(body.given) from None
        # Instances of a model the projection has no row of (a log from before models had
        # events): deleting them was all there was to do.
        return {"status": "success", "deleted": live}
    except ModelInUse as exc:
        raise ApiError(409, f"model '{body.given}' could not be removed: {exc}") from None
    ctx.metrics.event_published(removal.event)
    return {"status": "success", "deleted": live}


# Not in the OpenAPI document: like GET /v1/events, a pull lasts as long as a runner takes to
# start, and the document's operations are the ones answered at once.
@router.post("/api/pull", response_model=None, include_in_schema=False)
async def pull(body: NamedRequest, ctx: Ctx) -> Response:
    """A model the cluster knows, or a built-in card (see api/ollama/pull.py)."""
    model_id = await ctx.resolve_model(body.given)
    state = await projection.cluster(ctx.engine)
    model = state.model(model_id)
    card = None
    if model is None:
        card = builtin_cards().get(model_id)
        if card is None:
            known = ", ".join(sorted(builtin_cards()))
            raise ApiError(
                404,
                f"pull model manifest: file does not exist: Shoal knows no model"
                f" '{body.given}' (built in: {known}); add others with `shoal models"
                " add`",
                param="model",
                code="model_not_found",
            )
    elif live_instance(state, model_id) is None:
        # Refused before the answer starts, with its status (a stream can only end in error).
        refused = placement_refusal(state, model)
        if refused is not None:
            raise refused
    lines = pull_lines(ctx, model_id, card, digest(model) if model else "0" * 64)
    if body.stream:
        return StreamingResponse(_ndjson(lines), media_type=NDJSON)
    last: dict[str, Any] = {}
    async for line in lines:
        last = line
    return JSONResponse(last)


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """A stream that started cannot change its status: a failure is its last line."""
    try:
        async for line in lines:
            yield ndjson(line)
    except ApiError as err:
        yield ndjson({"error": err.message})


# --- what Shoal leaves to `shoal models add` -------------------------------------------------
# (Not in the OpenAPI document: they are not operations Shoal offers, only clear refusals.)


def _unsupported(
    what: str, instead: str = "POST /api/pull or POST /v1/instances serves one"
) -> ApiError:
    return ApiError(
        501, f"{what} is not supported: Shoal manages models with `shoal models add` ({instead})"
    )


@router.post("/api/create", include_in_schema=False)
async def create() -> None:
    raise _unsupported("creating a model (/api/create)")


@router.post("/api/copy", include_in_schema=False)
async def copy() -> None:
    raise _unsupported(
        "copying a model (/api/copy)",
        "for another name of a model, give it an"
        " alias: `shoal up --alias NAME=MODEL`, or `aliases` on POST /v1/instances",
    )


@router.post("/api/push", include_in_schema=False)
async def push() -> None:
    raise _unsupported("pushing a model to a registry (/api/push)")


@router.api_route("/api/blobs/{blob}", methods=["HEAD", "GET", "POST"], include_in_schema=False)
async def blobs(blob: str) -> None:
    raise _unsupported("uploading model files (/api/blobs)")
