"""A request's images as read (``loading.py``), placed into its messages by the dialects'
translations: each image's record (``ImagePart``) found by the input that sent it, at its
place in the message's text. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from api.images.inputs import ImageInput
from bus.stores.parts import Part
from events.records import ImagePart


@dataclass(frozen=True)
class Images:
    """A request's images, read: each one's record by the text it was sent as, and the parts
    that store them all (each once)."""

    records: Mapping[str, ImagePart] = field(default_factory=dict)
    parts: tuple[Part, ...] = ()

    def at(self, given: ImageInput, offset: int) -> ImagePart:
        """The record of ``given``'s image, placed at ``offset`` of its message's content."""
        return self.records[given.key].model_copy(update={"at": offset})

    def placed(self, pieces: Iterable[str | ImageInput]) -> tuple[str, list[ImagePart]]:
        """A message's content from its pieces in order: its text, and its images, each
        placed where it came among the text."""
        texts: list[str] = []
        images: list[ImagePart] = []
        length = 0
        for piece in pieces:
            if isinstance(piece, str):
                texts.append(piece)
                length += len(piece)
            else:
                images.append(self.at(piece, length))
        return "".join(texts), images


NO_IMAGES = Images()
