"""Where a chat's images go in the text the model reads. Pure.

Chat templates know text: each image becomes a placeholder in its message's content, at its
place (``bus/stores/images.py``'s ``content_pieces``), numbered by its occurrence; once the template
has rendered the chat, each placeholder left in the text becomes the engine's media marker,
and the images are given to the engine in the markers' order. A template that drops a message
drops its images with it, and one that moves messages moves them with their text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from events.images import content_pieces
from events.records import ChatMessage, ImagePart
from structured.reply import InvalidRequest

_PLACEHOLDER = re.compile(r"<__shoal_image_(\d+)__>")


def placeholder(occurrence: int) -> str:
    return f"<__shoal_image_{occurrence}__>"


def with_placeholders(
    messages: Sequence[ChatMessage],
) -> tuple[list[ChatMessage], list[ImagePart]]:
    """The messages with a placeholder where each image goes (their images taken out), and
    the images in the order of their placeholders (an image sent twice is there twice)."""
    shown: list[ImagePart] = []
    out: list[ChatMessage] = []
    for m in messages:
        if _PLACEHOLDER.search(m.content):
            raise InvalidRequest("a message's text holds Shoal's image placeholder")
        if not m.images:
            out.append(m)
            continue
        text: list[str] = []
        for piece in content_pieces(m):
            if isinstance(piece, str):
                text.append(piece)
            else:
                text.append(placeholder(len(shown)))
                shown.append(piece)
        out.append(m.model_copy(update={"content": "".join(text), "images": []}))
    return out, shown


def placed(text: str, marker: str) -> tuple[str, list[int]]:
    """The rendered chat with each placeholder made the engine's media ``marker``, and which
    image (occurrence) each marker stands for, in order. A text that holds the marker itself
    cannot be read: the engine would look for an image there."""
    if marker in text:
        raise InvalidRequest(
            f"the prompt's text holds {marker}, the marker where the model reads an image:"
            " send it without it"
        )
    order = [int(m.group(1)) for m in _PLACEHOLDER.finditer(text)]
    return _PLACEHOLDER.sub(marker, text), order
