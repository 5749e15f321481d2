"""The Responses API's input items and their content parts, checked (each refusal names the
item and part): messages (text and images), function calls and their outputs, reasoning.
Pure; ``requests.py`` makes the chat of them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, model_validator

from api.body import RequestBody
from api.images.inputs import ImageInput, image_url

# Content kinds the models cannot take, and kinds of input items Shoal never makes.
_UNREADABLE = {"input_file": "a file", "input_audio": "audio"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
_ITEM_REFUSALS = {
    "item_reference": "item references are not supported: send the items themselves, or"
    " previous_response_id",
}


class ContentPart(RequestBody):
    type: str
    text: str | None = None
    refusal: str | None = None
    # An input_image's: a data URL or an http(s) one (a file id is refused), and its detail
    # (the model reads the image as it is, whatever the detail).
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    # Its image, as its item's validation read it.
    _image: ImageInput | None = PrivateAttr(default=None)

    def piece(self) -> str | ImageInput:
        """What the part adds to its message: its text, or its image."""
        if self._image is not None:
            return self._image
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _check_parts(content: str | list[ContentPart], where: str, images: bool) -> None:
    """Refuse what the models cannot read in a message's content (or a function call's
    output); ``images``: whether it may hold images (a user's message)."""
    for i, part in enumerate(content if isinstance(content, list) else []):
        what = _UNREADABLE.get(part.type)
        if what is not None:
            raise ValueError(
                f"{where}[{i}] is {what} ({part.type!r}), which Shoal does not take: send"
                " input_text parts, and images as input_image parts"
            )
        if part.type == "input_image":
            if not images:
                raise ValueError(f"{where}[{i}]: only a user message may hold an image")
            if part.image_url is None:
                raise ValueError(
                    f"{where}[{i}]: an input_image needs its image_url (file ids are not"
                    " supported: Shoal keeps no files)"
                )
            try:
                part._image = image_url(part.image_url)
            except ValueError as exc:
                raise ValueError(f"{where}[{i}]: {exc}") from None
        elif not (part.type == "refusal" or (part.type in _TEXT_PARTS and part.text is not None)):
            raise ValueError(f"{where}[{i}]: a part of type {part.type!r} is not supported")


def content_pieces(content: str | list[ContentPart]) -> list[str | ImageInput]:
    """A checked content's text and images, in order."""
    return [content] if isinstance(content, str) else [p.piece() for p in content]


def content_text(content: str | list[ContentPart]) -> str:
    return "".join(p for p in content_pieces(content) if isinstance(p, str))


class InputItem(RequestBody):
    """One item of ``input``: a message (``type`` may be left out), a ``function_call`` the
    model made, or a ``function_call_output`` answering one."""

    type: str = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: Annotated[str, Field(min_length=1)] | None = None
    name: str | None = None
    arguments: str = ""
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None  # a reasoning item's
    encrypted_content: str | None = None  # a reasoning item's: another server's, unreadable

    @model_validator(mode="after")
    def _known(self) -> InputItem:
        if self.type in _ITEM_REFUSALS:
            raise ValueError(_ITEM_REFUSALS[self.type])
        if self.type == "message":
            if self.role is None or self.content is None:
                raise ValueError("a message item needs its role and content")
            _check_parts(self.content, "content", images=self.role == "user")
        elif self.type == "function_call":
            if not self.call_id or not self.name:
                raise ValueError("a function_call item needs its call_id and name")
        elif self.type == "function_call_output":
            if not self.call_id or self.output is None:
                raise ValueError("a function_call_output item needs its call_id and output")
            _check_parts(self.output, "output", images=False)
        elif self.type == "reasoning":
            for i, part in enumerate(self.content if isinstance(self.content, list) else []):
                if part.type != "reasoning_text":
                    raise ValueError(f"content[{i}]: a reasoning item holds reasoning_text parts")
        else:
            raise ValueError(
                f"input items of type {self.type!r} are not supported: send"
                " messages, reasoning, function_call and function_call_output items"
            )
        return self

    def text(self) -> str:
        if self.type == "reasoning":
            parts = self.content if isinstance(self.content, list) else []
            return "".join(p.text or "" for p in parts)
        body = self.content if self.type == "message" else self.output
        return content_text(body) if body is not None else ""

    def images(self, index: int) -> list[ImageInput]:
        """The images the item sends (item ``index`` of the input)."""
        parts = self.content if self.type == "message" and isinstance(self.content, list) else []
        return [
            replace(p._image, where=f"input.{index}.content.{j}")
            for j, p in enumerate(parts)
            if p._image is not None
        ]
