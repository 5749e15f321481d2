"""What a message's images are, read from their records alone (nothing decoded, nothing
fetched): where each goes in the text, and whether a request's images may be decoded at all.
Their bytes are stored by digest as prompt parts are (``bus/images.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from events.records import ChatMessage, ImagePart

# What one request's images may ask an engine to decode (each occurrence counts: an image sent
# 40 times is decoded 40 times): at most this many images, and this many pixels in all (64 Mi
# pixels: 192 MiB as RGB, where one 65 KB PNG of 8192 x 8192 says 192 MiB by itself). The API
# refuses more before anything is queued (api/images/loading.py); a runner, before decoding.
MAX_IMAGES = 16
MAX_TOTAL_PIXELS = 64 * 1024 * 1024


def images_of(messages: Sequence[ChatMessage]) -> list[ImagePart]:
    """The images of ``messages``, in order, each once (by digest)."""
    seen: dict[str, ImagePart] = {}
    for m in messages:
        for image in m.images:
            seen.setdefault(image.sha256, image)
    return list(seen.values())


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
