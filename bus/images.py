"""A message's images, stored by digest as prompt parts are (``bus/parts.py``): no event
holds an image's bytes, so the 1 MiB of a NATS message is not an image's limit.

An image is a chain of parts on ``SHOAL_PARTS``, each a piece of its bytes in base64 (a part is
a JSON value), ``IMAGE_PIECE_BYTES`` at most, so that each fits in one NATS message. The
message names the image with an ``ImagePart``: its own SHA-256, format and size, and the
``PartRef`` of its chain. The same bytes make the same chain, whichever dialect sent them and
however (a data URL, base64, a URL fetched): an image sent again is stored once, and ages out
with the events as other parts do. The runner reads the bytes back with ``image_bytes``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence

from bus.parts import Part, PartMissing, PartStore, chain, ref_of
from events.records import ChatMessage, ImageMediaType, ImagePart

# What one request's images may ask an engine to decode (each occurrence counts: an image sent
# 40 times is decoded 40 times): at most this many images, and this many pixels in all (64 Mi
# pixels: 192 MiB as RGB, where one 65 KB PNG of 8192 x 8192 says 192 MiB by itself). The API
# refuses more before anything is queued (api/images/loading.py); a runner, before decoding.
MAX_IMAGES = 16
MAX_TOTAL_PIXELS = 64 * 1024 * 1024
# Bytes of an image per part: in base64 about 0.7 MB, within NATS's default 1 MiB message.
IMAGE_PIECE_BYTES = 512 * 1024
# What a part adds to its value: {"parent":"<64 hex digits>","value":"..."} (88 bytes).
PART_OVERHEAD = 128


def piece_bytes(limit: int) -> int:
    """An image's bytes per part for a server whose messages hold ``limit`` bytes:
    IMAGE_PIECE_BYTES, or fewer where they would not fit (a multiple of 3: only the last
    piece's base64 is padded)."""
    fits = (limit - PART_OVERHEAD) // 4 * 3
    return max(3, min(IMAGE_PIECE_BYTES, fits))


def image_chain(data: bytes, piece: int = IMAGE_PIECE_BYTES) -> list[Part]:
    """``data`` as the parts of a chain, ``piece`` bytes each (pure)."""
    pieces = [data[i : i + piece] for i in range(0, len(data), piece)]
    return chain([base64.b64encode(p).decode("ascii") for p in pieces])


def stored_image(
    data: bytes,
    media_type: ImageMediaType,
    width: int,
    height: int,
    piece: int = IMAGE_PIECE_BYTES,
) -> tuple[ImagePart, list[Part]]:
    """The record that names image ``data`` and the parts that store it (pure: nothing is
    stored). ``data`` is not empty."""
    parts = image_chain(data, piece)
    ref = ref_of(parts)
    assert ref is not None, "an image has bytes"
    image = ImagePart(
        sha256=hashlib.sha256(data).hexdigest(),
        media_type=media_type,
        width=width,
        height=height,
        bytes=len(data),
        ref=ref,
    )
    return image, parts


async def image_bytes(store: PartStore, image: ImagePart) -> bytes:
    """The bytes of ``image``, read from its parts and checked against its digest
    (``PartMissing`` when they are gone, or are not its bytes). The parts are not kept in the
    store's cache: a conversation's messages are what the next turn reads again."""
    pieces = await store.get(image.ref, keep=False)
    try:
        data = b"".join(base64.b64decode(p, validate=True) for p in pieces)
    except (binascii.Error, TypeError, ValueError):
        raise PartMissing(f"image {image.sha256}: its parts are not base64") from None
    if len(data) != image.bytes or hashlib.sha256(data).hexdigest() != image.sha256:
        raise PartMissing(f"image {image.sha256}: its parts are not its bytes")
    return data


def images_of(messages: Sequence[ChatMessage]) -> list[ImagePart]:
    """The images of ``messages``, in order, each once (by digest)."""
    seen: dict[str, ImagePart] = {}
    for m in messages:
        for image in m.images:
            seen.setdefault(image.sha256, image)
    return list(seen.values())


async def task_images(store: PartStore, messages: Sequence[ChatMessage]) -> dict[str, bytes]:
    """The bytes of every image of ``messages`` (a task's, resolved), by digest, each read
    once."""
    return {image.sha256: await image_bytes(store, image) for image in images_of(messages)}


def content_pieces(message: ChatMessage) -> list[str | ImagePart]:
    """The message's content as the model reads it: its text cut where its images go, and the
    images, in order (no empty text)."""
    pieces: list[str | ImagePart] = []
    start = 0
    for image in sorted(message.images, key=lambda i: i.at):
        at = min(image.at, len(message.content))
        if at > start:
            pieces.append(message.content[start:at])
        pieces.append(image)
        start = max(start, at)
    if start < len(message.content):
        pieces.append(message.content[start:])
    return pieces


def decode_refusal(
    images: Sequence[ImagePart], max_images: int = MAX_IMAGES, max_pixels: int = MAX_TOTAL_PIXELS
) -> str | None:
    """Why ``images`` (each occurrence) are too many, or too many pixels, to decode for one
    task; None when they may be decoded. From their records' headers: nothing is decoded."""
    if len(images) > max_images:
        return f"the request has {len(images)} images, more than the {max_images} one may have"
    pixels = sum(i.width * i.height for i in images)
    if pixels > max_pixels:
        return (
            f"the request's images have {pixels} pixels in all, more than the {max_pixels} one"
            " request's images may have (each time an image is sent counts)"
        )
    return None
