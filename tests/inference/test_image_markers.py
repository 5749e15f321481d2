"""Where a chat's images go in the text the model reads (inference/image_markers.py):
a placeholder where each image is in its message, the engine's marker where each is left
after the chat template, in order. Pure."""

from __future__ import annotations

import pytest

from bus.stores.images import stored_image
from events.records import ChatMessage, ImagePart
from harness.images import checkers_png, gradient_png
from inference.image_markers import placed, placeholder, with_placeholders
from structured.reply import InvalidRequest

MARKER = "<__media__>"


def _image(data: bytes, at: int) -> ImagePart:
    image, _ = stored_image(data, "image/png", 48, 40)
    return image.model_copy(update={"at": at})


A, B = _image(gradient_png(), 0), _image(checkers_png(), 0)


def test_each_image_is_a_placeholder_where_it_goes_in_its_message() -> None:
    before = ChatMessage(role="system", content="Be brief.")
    after_text = ChatMessage(
        role="user",
        content="Look: then this",
        images=[B.model_copy(update={"at": 6}), A.model_copy(update={"at": 15})],
    )
    first = ChatMessage(role="user", content="What is it?", images=[A])
    messages, shown = with_placeholders([before, first, after_text])
    assert messages[0] is before  # a message without images is as it was
    assert messages[1].content == f"{placeholder(0)}What is it?" and messages[1].images == []
    assert messages[2].content == f"Look: {placeholder(1)}then this{placeholder(2)}"
    # In order of their places, an image sent twice twice.
    assert [i.sha256 for i in shown] == [A.sha256, B.sha256, A.sha256]


def test_the_rendered_chat_has_the_marker_where_each_image_is_left() -> None:
    text = f"<s>user\n{placeholder(0)}What?</s><s>user\nAnd {placeholder(2)} {placeholder(1)}"
    marked, order = placed(text, MARKER)
    assert marked == f"<s>user\n{MARKER}What?</s><s>user\nAnd {MARKER} {MARKER}"
    assert order == [0, 2, 1]  # the images in the markers' order
    # A template that dropped a message dropped its image with it.
    assert placed(f"a {placeholder(1)}", MARKER) == (f"a {MARKER}", [1])


def test_a_text_that_holds_the_marker_or_a_placeholder_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="holds <__media__>"):
        placed(f"{MARKER} {placeholder(0)}", MARKER)
    sneaky = ChatMessage(role="user", content=f"{placeholder(3)}", images=[A])
    with pytest.raises(InvalidRequest, match="placeholder"):
        with_placeholders([sneaky])
