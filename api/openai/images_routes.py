"""``POST /v1/images/generations`` (OpenAI's image API): a prompt becomes an image task
(``TaskCreated`` of kind ``image``) for an image model's runner (``engine`` diffusers), and the
PNGs it makes come back as ``b64_json`` or a ``url`` of this API (``GET
/v1/images/files/{name}``, read back from where the runner stored them), whole or streamed
(``stream``, with ``partial_images``: ``image_generation.partial_image`` then
``image_generation.completed`` server-sent events), as the ``openai`` SDK's
``client.images.generate`` reads them.

Honoured: ``model``, ``prompt``, ``n`` (1-8), ``size`` (``WIDTHxHEIGHT``, or ``auto``: 512 x
512), ``response_format``, ``output_format`` ``png``, ``stream``, ``partial_images`` (0-3),
``user``; and the common extensions ``seed``, ``steps`` (or ``num_inference_steps``),
``guidance`` (or ``guidance_scale``) and ``negative_prompt``. A field that would change the
image and that Shoal cannot honour is a 400 naming it: another ``output_format``,
``output_compression``, a transparent ``background``, a ``quality`` or ``style`` asked for (the
model's steps and guidance are what there is), a ``url`` streamed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AliasChoices, Field, ValidationError
from starlette.types import Receive

from api import projection
from api.body import RequestBody
from api.context import ApiContext, context, require_key
from api.errors import ApiError
from api.image_task import Made, generated
from api.serving import require_storable, sse
from bus.stores.images import image_bytes
from bus.stores.parts import PartMissing, PartStore
from events.catalogue import TaskCompleted, TaskCreated, new_id
from events.kinds import makes_images
from events.records import (
    MAX_IMAGE_SIDE,
    MAX_IMAGE_STEPS,
    MAX_IMAGES_PER_TASK,
    MAX_PARTIAL_IMAGES,
    ImageParams,
    ImagePart,
    PartRef,
)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
Ctx = Annotated[ApiContext, Depends(context)]

Item = Made | TaskCompleted
T = TypeVar("T")
DEFAULT_SIDE = 512
MAX_PROMPT_CHARS = 32_000  # OpenAI's, for its GPT image models


class ImageGenerationRequest(RequestBody):
    model: str | None = None
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_TASK)
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    output_compression: int | None = None
    background: str | None = None
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None  # accepted: no moderation model runs here either way
    stream: bool = False
    partial_images: int | None = Field(default=None, ge=0, le=MAX_PARTIAL_IMAGES)
    user: str | None = Field(default=None, max_length=255)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1 - MAX_IMAGES_PER_TASK)
    steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_IMAGE_STEPS,
        validation_alias=AliasChoices("steps", "num_inference_steps"),
    )
    guidance: float | None = Field(
        default=None, ge=0.0, le=30.0, validation_alias=AliasChoices("guidance", "guidance_scale")
    )
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)


def refused_fields(body: ImageGenerationRequest) -> list[str]:
    """The fields of ``body`` that Shoal cannot honour (pure), each with what was asked."""
    refused = []
    if body.response_format not in (None, "b64_json", "url"):
        refused.append(f"response_format {body.response_format!r} (b64_json or url)")
    if body.response_format == "url" and body.stream:
        refused.append("response_format 'url' with stream (a stream's images are b64_json)")
    if body.output_format not in (None, "png"):
        refused.append(f"output_format {body.output_format!r} (Shoal makes png)")
    if body.output_compression is not None:
        refused.append("output_compression (a png is not compressed by a quality)")
    if body.background not in (None, "auto", "opaque"):
        refused.append(f"background {body.background!r} (the models make opaque images)")
    if body.quality not in (None, "auto", "standard"):
        refused.append(f"quality {body.quality!r} (ask for steps instead)")
    if body.style is not None:
        refused.append(f"style {body.style!r} (say it in the prompt)")
    return refused


def size_of(size: str | None) -> tuple[int, int]:
    """(width, height) of OpenAI's ``size`` (``WIDTHxHEIGHT``; ``auto`` or none: 512 x 512);
    ``ApiError`` 400 for another shape or a side out of range."""
    if size in (None, "auto"):
        return DEFAULT_SIDE, DEFAULT_SIDE
    assert size is not None
    width, sep, height = size.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit()):
        raise ApiError(400, f"size {size!r}: give WIDTHxHEIGHT, such as 512x512", param="size")
    w, h = int(width), int(height)
    if not (8 <= w <= MAX_IMAGE_SIDE and 8 <= h <= MAX_IMAGE_SIDE):
        raise ApiError(
            400, f"size {size!r}: each side is 8 to {MAX_IMAGE_SIDE} pixels", param="size"
        )
    return w, h


def image_task(body: ImageGenerationRequest, model_id: str, origin: str) -> TaskCreated:
    """The task ``body`` asks for. A request without a seed is given one here, so that the log
    holds it: a task generated again (its runner lost) makes the same images."""
    width, height = size_of(body.size)
    seed = body.seed if body.seed is not None else random.randrange(2**62)
    return TaskCreated(
        task_id=new_id(),
        model_id=model_id,
        origin=origin,
        kind="image",
        prompt=body.prompt,
        user=body.user,
        image=ImageParams(
            n=body.n,
            width=width,
            height=height,
            steps=body.steps,
            guidance=body.guidance,
            seed=seed,
            negative_prompt=body.negative_prompt,
            partial_images=(body.partial_images or 0) if body.stream else 0,
        ),
    )


@router.post("/images/generations", response_model=None)
async def images_generations(
    body: ImageGenerationRequest, ctx: Ctx, request: Request
) -> JSONResponse | StreamingResponse:
    refused = refused_fields(body)
    if refused:
        names = ", ".join(r.split(" ", 1)[0] for r in refused)
        raise ApiError(
            400, f"this server cannot honour: {'; '.join(refused)}", param=names.split(", ")[0]
        )
    model_id = await ctx.resolve_model(body.model)
    row = await projection.model_row(ctx.engine, model_id)
    if row is not None and not makes_images(row.engines):
        raise ApiError(
            400,
            f"model {model_id} does not make images: ask an image model (engine diffusers)",
            param="model",
        )
    task = image_task(body, model_id, ctx.origin)
    require_storable(ctx, task, "prompt")
    size = f"{task.image.width}x{task.image.height}" if task.image else "auto"
    if body.stream:
        # The response starts with the task's first image (a partial one where asked): a
        # refusal before it (the key's limits, the model not serving) is the request's error.
        items = generated(ctx, task)
        first = await anext(items)
        return StreamingResponse(
            _streamed(_chained(first, items), size), media_type="text/event-stream"
        )
    images = await _unless_gone(_finished(ctx, task), request)
    if body.response_format == "url":
        # The address the client reached this API by (its Host, which the guard checked).
        base = str(request.base_url).rstrip("/")
        data = [{"url": _url(base, images[i])} for i in sorted(images)]
    else:
        data = [{"b64_json": _b64(images[i].png)} for i in sorted(images)]
    return JSONResponse(
        {
            "created": int(time.time()),
            "data": data,
            "background": "opaque",
            "output_format": "png",
            "quality": "auto",
            "size": size,
        }
    )


async def _chained(first: Item, rest: AsyncIterator[Item]) -> AsyncIterator[Item]:
    yield first
    async for item in rest:
        yield item


async def _streamed(items: AsyncIterator[Item], size: str) -> AsyncIterator[str]:
    """OpenAI's image stream: each partial image, then each finished one as it comes (its usage
    the steps it took); an error after the stream began is an ``error`` event."""
    shape = {"background": "opaque", "output_format": "png", "quality": "auto", "size": size}
    try:
        async for item in items:
            if isinstance(item, TaskCompleted):
                continue
            if item.partial is not None:
                event = "image_generation.partial_image"
                payload: dict[str, Any] = {
                    "type": event,
                    "b64_json": _b64(item.png),
                    "created_at": int(time.time()),
                    "partial_image_index": item.partial,
                    **shape,
                }
                yield sse(payload, event)
            else:
                yield _completed(item, shape)
    except ApiError as exc:
        error = {"type": "error", "error": {"message": exc.message, "code": exc.code}}
        yield sse(error, "error")


def _completed(made: Made, shape: dict[str, str]) -> str:
    steps = made.steps
    event = "image_generation.completed"
    payload = {
        "type": event,
        "b64_json": _b64(made.png),
        "created_at": int(time.time()),
        **shape,
        # An image model's "tokens" are its steps; no prompt tokens are counted.
        "usage": {
            "input_tokens": 0,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "output_tokens": steps,
            "total_tokens": steps,
        },
    }
    return sse(payload, event)


async def _finished(ctx: ApiContext, task: TaskCreated) -> dict[int, Made]:
    """The task's finished images, by index."""
    images: dict[int, Made] = {}
    async for item in generated(ctx, task):
        if isinstance(item, Made) and item.partial is None:
            images[item.index] = item
    return images


async def _unless_gone(work: Coroutine[Any, Any, T], request: Request) -> T:
    """``work``'s result; cancelled if the client goes away first (Starlette runs a plain
    response's endpoint to its end, and an image takes seconds to minutes): the task is then
    cancelled too, and the runner stops after the step under way."""
    working = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({working, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not working.done():
            working.cancel()
    if working.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await working
        raise ApiError(499, "the client went away", code="client_gone")
    return working.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def file_name(image: ImagePart) -> str:
    """The name ``GET /v1/images/files/{name}`` reads an image back by: its digest and size,
    and its stored parts' reference (pure). Unguessable: it holds the image's SHA-256."""
    ref = image.ref
    return f"{image.sha256}-{image.bytes}-{ref.digest}-{ref.parts}-{ref.bytes}.png"


def image_of(name: str) -> ImagePart | None:
    """The image a file name names (``file_name``'s inverse), None for another name."""
    fields = name.removesuffix(".png").split("-")
    if not name.endswith(".png") or len(fields) != 5 or not all(f.isalnum() for f in fields):
        return None
    sha, size, digest, parts, stored = fields
    try:
        return ImagePart(
            sha256=sha,
            media_type="image/png",
            width=1,
            height=1,
            bytes=int(size),
            ref=PartRef(digest=digest, parts=int(parts), bytes=int(stored)),
        )
    except (ValueError, ValidationError):
        return None


@router.get("/images/files/{name}", response_model=None)
async def image_file(name: str, ctx: Ctx) -> Response:
    """An image a task made, by the name its ``url`` gave (while the log keeps its parts)."""
    image = image_of(name)
    if image is None:
        raise ApiError(404, f"no image {name}", code="not_found")
    try:
        png = await image_bytes(PartStore(ctx.nc.jetstream()), image)
    except PartMissing:
        raise ApiError(404, f"no image {name} (gone, or never made)", code="not_found") from None
    return Response(png, media_type="image/png")


def _url(base: str, made: Made) -> str:
    if made.image is None:
        raise ApiError(500, "the image has no stored reference")
    return f"{base}/v1/images/files/{file_name(made.image)}"


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")
