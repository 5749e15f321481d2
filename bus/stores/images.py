"""A message's images, stored by digest as prompt parts are (``bus/stores/parts.py``): no event
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

from bus.stores.parts import Part, PartMissing, PartStore, chain, ref_of
from events.images import images_of
from events.records import ChatMessage, ImageMediaType, ImagePart

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


async def task_images(store: PartStore, messages: Sequence[ChatMessage]) -> dict[str, bytes]:
    """The bytes of every image of ``messages`` (a task's, resolved), by digest, each read
    once."""
    return {image.sha256: await image_bytes(store, image) for image in images_of(messages)}
