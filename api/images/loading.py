"""A request's images, whatever its dialect, read and checked, and made ready to be stored by
digest (``bus/stores/images.py``) before its task is published.

In order, each refusal in the client's own error shape, naming the field the image came in:

0. more than ``max_images`` images (each time one is sent counts: the engine decodes each), or
   more than ``max_urls`` image URLs, are a 413 before any is read;
1. each image sent as data is decoded: a 413 over the limit (``ApiConfig.max_image_bytes``,
   10 MiB by default), a 400 for base64 that is not, or for bytes
   that are not a PNG, JPEG, WebP or GIF (``api/images/formats.py``), a 413 for more than
   ``MAX_PIXELS``; an image URL is a 400 unless the API fetches them (``--allow-image-urls``);
2. the model must take images (``api/images/vision.py``: it has a projector file): a 400
   otherwise;
3. the pixels of all the request's images, read from their headers (nothing is decoded),
   must be at most ``max_pixels`` (a 413): checked once the data images are read, and again
   after each URL is fetched;
4. each image URL is fetched (``api/images/fetching.py``: public addresses only) and checked
   as above, once the request would pass its key's rate limit and its model's queue
   (``would_pass``), and within ``max_fetched`` bytes for all of them;
5. each image becomes its record (its digest, format, size and ``PartRef``) and the parts that
   store it. An image sent twice (the same text) is read once.

The dialects' translations then place each image's record in its message
(``api/images/placed.py``), and
``api/serving.py`` stores the parts with the task's other parts (``stored_images`` stores
them for a request that makes no task: a count of its tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import nats.errors

from api import projection, serving
from api.config import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_FETCH_BYTES,
    DEFAULT_MAX_IMAGE_URLS,
)
from api.context import ApiContext
from api.errors import ApiError
from api.images.fetching import AddressCheck, fetch_image, public_address
from api.images.formats import MAX_PIXELS, ImageInfo, UnreadableImage, read_header
from api.images.inputs import ImageInput, decoded, refused
from api.images.placed import NO_IMAGES, Images
from api.images.vision import accepts_images, engine_of, no_images
from api.serving import log_unavailable
from bus.stores.images import IMAGE_PIECE_BYTES, piece_bytes, stored_image
from bus.stores.parts import Part
from events.images import MAX_IMAGES, MAX_TOTAL_PIXELS
from events.kinds import Engine
from events.records import ImagePart
from services.models.catalogue import builtin_cards


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be, and whether its model takes them."""

    accepts: bool = False
    engine: Engine = "llamacpp"  # the model's (its refusal names MLX's limit)
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allow_urls: bool = False
    # An image's bytes per stored part (bus/stores/images.py: what the server's messages hold).
    piece: int = IMAGE_PIECE_BYTES
    # Which addresses an image URL may resolve to (tests allow loopback).
    allowed: AddressCheck = public_address
    # What one request's images may be in all (bus/stores/images.py, api/config.py).
    max_images: int = MAX_IMAGES
    max_pixels: int = MAX_TOTAL_PIXELS
    max_urls: int = DEFAULT_MAX_IMAGE_URLS
    max_fetched: int = DEFAULT_MAX_IMAGE_FETCH_BYTES


Precheck = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


async def read_images(
    inputs: Sequence[ImageInput],
    model_id: str,
    policy: ImagePolicy,
    before_fetching: Precheck = _nothing,
) -> Images:
    """The images of a request for ``model_id``, read and checked (``ApiError`` otherwise);
    ``before_fetching``: what an image URL waits for (the refusals the request would get)."""
    distinct: dict[str, ImageInput] = {}
    for given in inputs:
        distinct.setdefault(given.key, given)
    if not distinct:
        return NO_IMAGES
    _require_few(inputs, policy)
    read: dict[str, tuple[bytes, ImageInfo]] = {}
    for key, given in distinct.items():
        if given.base64 is not None:
            read[key] = await asyncio.to_thread(_decoded, given, policy.max_bytes)
        elif not policy.allow_urls:
            raise refused(
                400,
                "this API does not fetch image URLs (its operator may allow it:"
                " --allow-image-urls): send the image itself, as a data URL"
                " (data:image/png;base64,...)",
                given,
            )
    _require_pixels(inputs, read, policy)
    if not policy.accepts:
        first = next(iter(distinct.values()))
        raise ApiError(
            400,
            no_images(model_id, policy.engine),
            param=first.where or None,
            code="images_not_supported",
        )
    urls = [given for key, given in distinct.items() if key not in read]
    if urls:
        await before_fetching()
    fetched = 0
    for given in urls:
        room = policy.max_fetched - fetched
        if room <= 0:
            raise refused(413, _fetch_limit(policy), given)
        try:
            data = await fetch_image(given, min(policy.max_bytes, room), allowed=policy.allowed)
        except ApiError as err:
            if err.status == 413 and room < policy.max_bytes:
                raise refused(413, _fetch_limit(policy), given) from None
            raise
        fetched += len(data)
        read[given.key] = (data, checked(given, data))
        _require_pixels(inputs, read, policy)
    records: dict[str, ImagePart] = {}
    parts: dict[str, Part] = {}
    for key, (data, info) in read.items():
        image, chain = await asyncio.to_thread(
            stored_image, data, info.media_type, info.width, info.height, policy.piece
        )
        records[key] = image
        parts |= {p.digest: p for p in chain}
    return Images(records, tuple(parts.values()))


def _require_few(inputs: Sequence[ImageInput], policy: ImagePolicy) -> None:
    """The 413 of more images, or image URLs, than a request may have."""
    if len(inputs) > policy.max_images:
        raise refused(
            413,
            f"the request has {len(inputs)} images, more than the {policy.max_images} a request"
            " may have here (each time an image is sent counts)",
            inputs[policy.max_images],
        )
    urls = [i for i in inputs if i.url is not None]
    if len(urls) > policy.max_urls:
        raise refused(
            413,
            f"the request has {len(urls)} image URLs, more than the {policy.max_urls} a request"
            " may have here: send the others as data",
            urls[policy.max_urls],
        )


def _require_pixels(
    inputs: Sequence[ImageInput], read: dict[str, tuple[bytes, ImageInfo]], policy: ImagePolicy
) -> None:
    """The 413 of images (those read so far, each time it is sent) with more pixels in all
    than a request's may have: the engine would decode them all."""
    total = 0
    for given in inputs:
        found = read.get(given.key)
        total += found[1].pixels if found is not None else 0
        if total > policy.max_pixels:
            raise refused(
                413,
                f"the request's images have more than {policy.max_pixels} pixels in all (the"
                " most a request's may have here, each time an image is sent counting): send"
                " fewer or smaller images",
                given,
            )


def _fetch_limit(policy: ImagePolicy) -> str:
    return (
        f"the request's image URLs give more than {policy.max_fetched} bytes in all, the most"
        " this API fetches for one request: send the images as data"
    )


def checked(given: ImageInput, data: bytes) -> ImageInfo:
    """What image ``data`` is: a 400 when it is none Shoal takes, a 413 when it has too many
    pixels."""
    try:
        info = read_header(data)
    except UnreadableImage as exc:
        raise refused(400, f"the image cannot be read: {exc}", given) from None
    if info.pixels > MAX_PIXELS:
        raise refused(
            413,
            f"the image is {info.width}x{info.height} pixels, more than the {MAX_PIXELS}"
            " an image may have here",
            given,
        )
    return info


def _decoded(given: ImageInput, max_bytes: int) -> tuple[bytes, ImageInfo]:
    data = decoded(given, max_bytes)
    return data, checked(given, data)


async def policy_of(ctx: ApiContext, model_id: str) -> ImagePolicy:
    """What this API takes, for a request to ``model_id`` (whether the model does: read
    from the projection, only for a request with an image)."""
    model = await projection.model_row(ctx.engine, model_id)
    card = builtin_cards().get(model_id)
    return ImagePolicy(
        accepts=accepts_images(model, card),
        engine=engine_of(model, card),
        max_bytes=ctx.config.max_image_bytes,
        allow_urls=ctx.config.allow_image_urls,
        piece=piece_bytes(ctx.nc.max_payload),
        max_images=ctx.config.max_images,
        max_pixels=ctx.config.max_image_pixels,
        max_urls=ctx.config.max_image_urls,
        max_fetched=ctx.config.max_image_fetch_bytes,
    )


async def request_images(ctx: ApiContext, model_id: str, inputs: Sequence[ImageInput]) -> Images:
    """The images of a request to ``model_id`` (none: at no cost)."""
    if not inputs:
        return NO_IMAGES

    async def would_pass() -> None:
        await serving.would_pass(ctx, model_id)

    return await read_images(inputs, model_id, await policy_of(ctx, model_id), would_pass)


async def stored_images(ctx: ApiContext, model_id: str, inputs: Sequence[ImageInput]) -> Images:
    """The images of a request to ``model_id`` that is no task (a count of its tokens: the
    runner asked reads them), stored now."""
    images = await request_images(ctx, model_id, inputs)
    if images.parts:
        try:
            await ctx.parts.store(images.parts)
        except (nats.errors.Error, TimeoutError) as exc:
            raise log_unavailable(exc) from exc
    return images
