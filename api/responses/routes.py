"""The OpenAI Responses API: ``POST /v1/responses`` (whole, streamed, or in the background),
``GET`` and ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/input_tokens``.

A response's id is its task's, ``resp_<task_id>``. A stored response (``store``, the default)
lives on the log (api/responses/store.py), so any API process serves, continues
(``previous_response_id``) and deletes it. A background response runs in this process, which
stores it queued at once and again when it is done; a process that stops meanwhile leaves it
queued (its task is cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Literal

import nats.errors
from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, StreamingResponse

from api import admission, keys
from api.context import ApiContext, context, require_key
from api.errors import ApiError
from api.images.loading import request_images, stored_images
from api.images.placed import Images
from api.responses import store as response_store
from api.responses.counting import count_question, input_tokens
from api.responses.requests import (
    RESPONSE_PREFIX,
    ResponsesBody,
    ResponsesRequest,
    chat_task,
    continued,
    input_items,
    task_id_of,
)
from api.responses.shapes import Head, Json, Keep, ResponsesOut, failed_response
from api.serving import log_unavailable, require_serving, serve, staged
from api.thinking import shown
from api.tokenizer.asking import ask
from events.catalogue import ResponseStored, TaskCancelled, TaskCreated, new_id, utc_now
from events.records import ChatMessage
from events.states import TASK_ENDED

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]

# Background responses being served, kept referenced until done (the loop holds them weakly).
_RUNNING: set[asyncio.Task[None]] = set()


@router.post("/responses", response_model=None)
async def create_response(body: ResponsesRequest, ctx: Ctx) -> JSONResponse | StreamingResponse:
    return await serve_responses(ctx, body)


@router.post("/responses/input_tokens")
async def count_input_tokens(body: ResponsesBody, ctx: Ctx) -> Json:
    """The input's tokens as the model would read them in a response of the same body (its
    chat template, the instructions, the tools, the conversation a ``previous_response_id``
    continues), counted by a runner of the model without generating
    (``api/tokenizer/asking.py``): the API has no tokenizer."""
    model_id = await ctx.resolve_model(body.model)
    previous = await _previous(ctx, body.previous_response_id)
    images = await stored_images(ctx, model_id, body.image_inputs())
    conversation = continued(previous, body, images)
    question = count_question(body, conversation, model_id, ctx.origin)
    counted = await ask(ctx, model_id, question, "input")
    return input_tokens(counted)


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, ctx: Ctx, stream: bool = False) -> Json:
    if stream:
        raise ApiError(
            400, "stream is not supported here: a stored response is sent whole", param="stream"
        )
    return (await _stored(ctx, response_id)).response


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, ctx: Ctx) -> Json:
    found = await _stored(ctx, response_id)
    await response_store.delete(ctx, response_id)
    if found.status in response_store.ACTIVE:
        await _cancel_task(ctx, found.task_id, found.model_id, "its response was deleted")
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str, ctx: Ctx) -> Json:
    task_id = task_id_of(response_id)
    found = await response_store.find(ctx, response_id) if task_id is not None else None
    if found is None:
        # Not stored (yet): a streamed response in progress, found by its task.
        task = await response_store.task(ctx, task_id) if task_id is not None else None
        if task is None or task.status in TASK_ENDED or not keys.current().sees(task.owner):
            raise _not_found(response_id)
        await _cancel_task(ctx, task.task_id, task.model_id, "its response was cancelled")
        created = int(task.created_at.timestamp()) if task.created_at else 0
        settings = ResponsesRequest.model_construct().echoed()
        return Head(response_id, task.task_id, task.model_id, created, settings).response(
            "cancelled", []
        )
    if found.status == "cancelled":
        return found.response
    if found.status not in response_store.ACTIVE:
        raise ApiError(
            400,
            f"Cannot cancel a response whose status is {found.status!r}: only a"
            " queued or in-progress response can be cancelled.",
        )
    await _cancel_task(ctx, found.task_id, found.model_id, "its response was cancelled")
    cancelled = found.response | {"status": "cancelled"}
    await response_store.store(
        ctx,
        found.model_copy(
            update={
                "status": "cancelled",
                "response": cancelled,
                "event_id": new_id(),
                "ts": utc_now(),
                "origin": ctx.origin,
            }
        ),
    )
    return cancelled


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> Json:
    stored = await response_store.whole(ctx, await _stored(ctx, response_id))
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


async def serve_responses(
    ctx: ApiContext, body: ResponsesRequest
) -> JSONResponse | StreamingResponse:
    model_id = await ctx.resolve_model(body.model)
    previous = await _previous(ctx, body.previous_response_id)
    images = await request_images(ctx, model_id, body.image_inputs())
    conversation = continued(previous, body, images)
    task = chat_task(body, conversation, model_id, ctx.origin, body.sampling(), body.user)
    head = Head(
        RESPONSE_PREFIX + task.task_id,
        task.task_id,
        body.model or model_id,
        int(time.time()),
        body.echoed(),
        body.namespaces(),
    )
    keep = _keeper(ctx, head, task, input_items(body.input, task.task_id), conversation)
    out = ResponsesOut(head, body.stream, keep if body.keep else None, shown(task.thinking))
    if body.background:
        return await _in_background(ctx, task, out, keep, images)
    return await serve(ctx, [task], body.stream, out, images)


async def _previous(ctx: ApiContext, response_id: str | None) -> list[ChatMessage]:
    """The conversation a request continues (its previous response's, output included)."""
    if response_id is None:
        return []
    found = await response_store.find(ctx, response_id) if task_id_of(response_id) else None
    if found is None:
        raise ApiError(
            404,
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if found.status in response_store.ACTIVE:
        raise ApiError(
            400,
            f"Previous response with id '{response_id}' is still"
            f" {found.status}: continue it once it is done.",
            param="previous_response_id",
        )
    return list((await response_store.whole(ctx, found)).conversation)


def _keeper(
    ctx: ApiContext,
    head: Head,
    task: TaskCreated,
    items: list[Json],
    conversation: list[ChatMessage],
) -> Keep:
    owner = keys.current().key_id  # now: the response may be kept from another task

    async def keep(response: Json, reply: ChatMessage | None) -> bool:
        event = ResponseStored.model_validate(
            {
                "response_id": head.response_id,
                "origin": ctx.origin,
                "task_id": task.task_id,
                "model_id": task.model_id,
                "owner": owner,
                "status": response["status"],
                "response": response,
                "input_items": items,
                "conversation": [*conversation, *([reply] if reply else [])],
            }
        )
        return await response_store.store(ctx, event)

    return keep


async def _in_background(
    ctx: ApiContext, task: TaskCreated, out: ResponsesOut, keep: Keep, images: Images
) -> JSONResponse:
    """Answer at once with the queued response, and serve it here meanwhile."""
    staged(ctx, task, out.too_large_param)  # a 413 now, not in the background
    capacity = await require_serving(ctx, task.model_id)
    # A full queue is a 429 now; once answered, the response waits for its turn whatever the
    # bound (admission.in_background).
    if (refused := ctx.admission.refusal(task.model_id, 1, capacity)) is not None:
        raise refused
    queued = out.head.response("queued", [])
    if not await keep(queued, None):
        raise ApiError(
            503,
            "the response could not be stored on the event log, and a background response must be",
            code="log_unavailable",
        )
    running = asyncio.get_running_loop().create_task(_background(ctx, task, out, keep, images))
    _RUNNING.add(running)
    running.add_done_callback(_RUNNING.discard)
    return JSONResponse(queued)


async def _background(
    ctx: ApiContext, task: TaskCreated, out: ResponsesOut, keep: Keep, images: Images
) -> None:
    admission.in_background()
    try:
        await serve(ctx, [task], False, out, images)  # stores the response when done (out.done)
    except ApiError as err:
        await keep(failed_response(out.head, err), None)
    except Exception:
        log.exception("background response %s failed", out.head.response_id)
        internal = ApiError(500, "internal error; the API's log has the details")
        await keep(failed_response(out.head, internal), None)


async def _stored(ctx: ApiContext, response_id: str) -> ResponseStored:
    found = await response_store.find(ctx, response_id) if task_id_of(response_id) else None
    if found is None:
        raise _not_found(response_id)
    return found


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", code="response_not_found")


async def _cancel_task(ctx: ApiContext, task_id: str, model_id: str, reason: str) -> None:
    try:
        await ctx.publish(
            TaskCancelled(task_id=task_id, model_id=model_id, origin=ctx.origin, reason=reason)
        )
    except (nats.errors.Error, TimeoutError) as exc:
        raise log_unavailable(exc) from exc
