"""A request's images, whatever its dialect, read and checked, and made ready to be stored by
digest (``bus/images.py``) before its task is published.

In order, each refusal in the client's own error shape, naming the field the image came in:

1. each image sent as data is decoded: a 413 over the limit (``ApiConfig.max_image_bytes``,
   10 MiB by default), a 400 for base64 that is not, or for bytes
   that are not a PNG, JPEG, WebP or GIF (``api/images/formats.py``), a 413 for more than
   ``MAX_PIXELS``; an image URL is a 400 unless the API fetches them (``--allow-image-urls``);
2. the model must take images (``api/images/vision.py``: it has a projector file): a 400
   otherwise;
3. each image URL is fetched (``api/images/fetching.py``: public addresses only) and checked
   as above;
4. each image becomes its record (its digest, format, size and ``PartRef``) and the parts that
   store it. An image sent twice (the same text) is read once.

The dialects' translations then place each image's record in its message
(``api/images/placed.py``), and
``api/serving.py`` stores the parts with the task's other parts (``stored_images`` stores
them for a request that makes no task: a count of its tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import nats.errors

from api import projection
from api.config import DEFAULT_MAX_IMAGE_BYTES
from api.context import ApiContext
from api.errors import ApiError
from api.images.fetching import AddressCheck, fetch_image, public_address
from api.images.formats import MAX_PIXELS, ImageInfo, UnreadableImage, read_header
from api.images.inputs import ImageInput, decoded, refused
from api.images.placed import NO_IMAGES, Images
from api.images.vision import accepts_images, engine_of, no_images
from api.serving import log_unavailable
from bus.images import IMAGE_PIECE_BYTES, piece_bytes, stored_image
from bus.kinds import Engine
from bus.parts import Part
from bus.records import ImagePart
from services.models.catalogue import builtin_cards


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be, and whether its model takes them."""

    accepts: bool = False
    engine: Engine = "llamacpp"  # the model's (its refusal names MLX's limit)
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    allow_urls: bool = False
    # An image's bytes per stored part (bus/images.py: what the server's messages hold).
    piece: int = IMAGE_PIECE_BYTES
    # Which addresses an image URL may resolve to (tests allow loopback).
    allowed: AddressCheck = public_address


async def read_images(inputs: Sequence[ImageInput], model_id: str, policy: ImagePolicy) -> Images:
    """The images of a request for ``model_id``, read and checked (``ApiError`` otherwise)."""
    distinct: dict[str, ImageInput] = {}
    for given in inputs:
        distinct.setdefault(given.key, given)
    if not distinct:
        return NO_IMAGES
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
    if not policy.accepts:
        first = next(iter(distinct.values()))
        raise ApiError(
            400,
            no_images(model_id, policy.engine),
            param=first.where or None,
            code="images_not_supported",
        )
    for key, given in distinct.items():
        if key not in read:
            data = await fetch_image(given, policy.max_bytes, allowed=policy.allowed)
            read[key] = (data, checked(given, data))
    records: dict[str, ImagePart] = {}
    parts: dict[str, Part] = {}
    for key, (data, info) in read.items():
        image, chain = await asyncio.to_thread(
            stored_image, data, info.media_type, info.width, info.height, policy.piece
        )
        records[key] = image
        parts |= {p.digest: p for p in chain}
    return Images(records, tuple(parts.values()))


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
    )


async def request_images(ctx: ApiContext, model_id: str, inputs: Sequence[ImageInput]) -> Images:
    """The images of a request to ``model_id`` (none: at no cost)."""
    if not inputs:
        return NO_IMAGES
    return await read_images(inputs, model_id, await policy_of(ctx, model_id))


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
