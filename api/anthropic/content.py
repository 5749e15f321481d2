"""A message's content in Anthropic's Messages API: its blocks, checked (each refusal names the
block), and the message as Shoal's messages: a user turn's text and images, its tool results
(each a ``tool`` message), an assistant's text, thinking and tool uses. Pure.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import PrivateAttr, model_validator

from api.body import RequestBody
from api.images.inputs import ImageInput, image_base64, image_url
from api.images.placed import NO_IMAGES, Images
from events.records import ChatMessage, ToolCall

# Blocks the models cannot read: the answer would be about something they never saw.
_UNREADABLE = {"document": "a document", "search_result": "a search result"}
# Blocks of Anthropic's server tools (and containers): Shoal runs no tools of its own.
_SERVER = (
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "container_upload",
    "mcp_tool_use",
    "mcp_tool_result",
)
# An earlier turn's thinking: its text is the turn's reasoning (a redacted one has none).
_THINKING = ("thinking", "redacted_thinking")
_ALLOWED = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", *_THINKING),
    "system": ("text",),
}


class ImageSource(RequestBody):
    """An image block's source: ``base64`` (with a ``media_type``, which the image's own bytes
    decide here) or ``url``; a ``file`` is refused (Shoal keeps no files)."""

    type: str | None = None
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(RequestBody):
    """A content block of any type; what a type needs is checked by the message holding it,
    which says what is wrong with which block."""

    type: str
    text: str | None = None
    source: ImageSource | None = None  # image
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    # An image block's image, as its message's validation read it.
    _image: ImageInput | None = PrivateAttr(default=None)

    def piece(self) -> str | ImageInput:
        """What a user's block adds to its message: its text, or its image."""
        return self._image if self._image is not None else self.text or ""


def _image_problem(block: Block) -> str | None:
    """What is wrong with an image block (None: nothing; its image is read into it)."""
    source = block.source
    if source is None or source.type is None:
        return "an image block needs its source (and the source its type)"
    try:
        if source.type == "base64" and source.data:
            block._image = image_base64(source.data)
        elif source.type == "url" and source.url:
            block._image = image_url(source.url)
        elif source.type in ("base64", "url"):
            needed = "data" if source.type == "base64" else "url"
            return f"an image's {source.type} source needs its {needed}"
        else:
            return (
                f"an image source of type {source.type!r} is not supported: send base64 or"
                " url (Shoal keeps no files)"
            )
    except ValueError as exc:
        return str(exc)
    return None


def block_problem(block: Block, allowed: tuple[str, ...]) -> str | None:
    what = _UNREADABLE.get(block.type)
    if what is not None:
        return (
            f"is {what} ({block.type!r}), which Shoal does not take: send text blocks, and"
            " images as image blocks"
        )
    if block.type in _SERVER:
        return f"is a {block.type!r} block: Shoal runs no server tools"
    if block.type not in allowed:
        return f"a block of type {block.type!r} is not supported here"
    if block.type == "text" and block.text is None:
        return "a text block needs its text"
    if block.type == "image":
        return _image_problem(block)
    if block.type == "tool_use" and not (block.id and block.name and isinstance(block.input, dict)):
        return "a tool_use block needs its id, name and input (an object)"
    if block.type == "tool_result":
        if not block.tool_use_id:
            return "a tool_result block needs the tool_use_id of the call it answers"
        for i, inner in enumerate(block.content if isinstance(block.content, list) else []):
            if (problem := block_problem(inner, ("text", "image"))) is not None:
                return at_field(f"content[{i}]", problem)
    return None


def at_field(where: str, problem: str) -> str:
    """``content[1] is an image``, ``content[0].content[1] is an image``."""
    return f"{where}{'.' if problem.startswith('content[') else ' '}{problem}"


def text_of(blocks: str | list[Block] | None) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    return "".join(b.text or "" for b in blocks if b.type == "text")


def _pieces(blocks: str | list[Block] | None) -> list[str | ImageInput]:
    """A user's (or a tool result's) text and images, in order."""
    if blocks is None:
        return []
    if isinstance(blocks, str):
        return [blocks]
    return [b.piece() for b in blocks if b.type in ("text", "image")]


def images_in(blocks: str | list[Block] | None, where: str) -> list[ImageInput]:
    """The images of ``blocks`` (those of ``where``) and of the tool results among them."""
    found: list[ImageInput] = []
    for i, b in enumerate(blocks if isinstance(blocks, list) else []):
        if b._image is not None:
            found.append(replace(b._image, where=f"{where}.{i}"))
        found += images_in(b.content, f"{where}.{i}.content")
    return found


class Message(RequestBody):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _blocks(self) -> Message:
        for i, block in enumerate(self.content if isinstance(self.content, list) else []):
            if (problem := block_problem(block, _ALLOWED[self.role])) is not None:
                raise ValueError(at_field(f"content[{i}]", problem))
        return self

    def chat_messages(self, images: Images = NO_IMAGES) -> list[ChatMessage]:
        """One message, or several: a user turn's tool results are each a ``tool`` message
        (in their order, among its text and images), an assistant's tool uses are its
        ``tool_calls``; ``images``: the request's images, read."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        if self.role == "assistant":
            calls = [
                ToolCall(id=b.id or "", name=b.name or "", arguments=json.dumps(b.input))
                for b in self.content
                if b.type == "tool_use"
            ]
            thought = "".join(b.thinking or "" for b in self.content if b.type == "thinking")
            return [
                ChatMessage(
                    role="assistant",
                    content=text_of(self.content),
                    tool_calls=calls,
                    reasoning=thought or None,
                )
            ]
        out: list[ChatMessage] = []
        pieces: list[str | ImageInput] = []
        for b in self.content:
            if b.type == "tool_result":
                if pieces:
                    content, placed = images.placed(pieces)
                    out.append(ChatMessage(role=self.role, content=content, images=placed))
                    pieces = []
                # The model is told the tool failed, as Anthropic's models are.
                failed: list[str | ImageInput] = ["Error: "] if b.is_error else []
                result, shown = images.placed([*failed, *_pieces(b.content)])
                out.append(
                    ChatMessage(
                        role="tool", content=result, images=shown, tool_call_id=b.tool_use_id
                    )
                )
            else:
                pieces.append(b.piece())
        if pieces or not out:
            content, placed = images.placed(pieces)
            out.append(ChatMessage(role=self.role, content=content, images=placed))
        return out
