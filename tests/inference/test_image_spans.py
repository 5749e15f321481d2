"""A prompt's images as the engine's batch sees them (inference/image_spans.py): the
tokens an image takes, the positions after it (fewer than its tokens with M-RoPE), how much of
the prompt the shared batch may take before an image, and a cached prefix never ending inside
one. Pure."""

from __future__ import annotations

from inference.image_spans import (
    ImagePrompt,
    ImageSpan,
    image_at,
    image_token,
    kept,
    position,
    text_run,
    without_first,
)

DIGEST = "ab" * 32
# text 0..3, a 64-token image at 4 (64 positions), text 68..71, a 16-token M-RoPE image at 72
# taking 4 positions, text from 88.
FIRST = ImageSpan(4, 64, 64, image_token(DIGEST, 0))
MROPE = ImageSpan(72, 16, 4, image_token(DIGEST, 1))
SPANS = (FIRST, MROPE)


def test_an_image_s_tokens_are_negative_and_its_own() -> None:
    token = image_token(DIGEST, 0)
    assert token < 0 and token == image_token(DIGEST, 0)
    assert token >= -(2**31)  # an int32, as mlx-lm keeps a sequence's tokens
    assert token != image_token(DIGEST, 1)  # another chunk of one image
    assert token != image_token("cd" * 32, 0)  # another image


def test_positions_go_on_after_an_image_from_its_positions() -> None:
    assert [position(SPANS, i) for i in (0, 4, 50, 68, 72)] == [0, 4, 50, 68, 72]
    assert position(SPANS, 88) == 76  # 72 + the image's 4 positions
    assert position(SPANS, 100) == 88  # a generated token's
    assert position((), 7) == 7


def test_the_batch_takes_text_up_to_the_next_image() -> None:
    assert text_run(SPANS, 0, 100) == 4
    assert text_run(SPANS, 68, 100) == 4
    assert text_run(SPANS, 88, 100) == 12
    assert text_run(SPANS, 100, 100) == 0  # decoding
    assert image_at(SPANS, 4) == FIRST and image_at(SPANS, 5) is None


def test_a_cached_prefix_never_ends_inside_an_image() -> None:
    assert kept(SPANS, 40) == 4  # the image is evaluated whole: from its start
    assert [kept(SPANS, k) for k in (0, 4, 68, 70, 90)] == [0, 4, 68, 70, 90]


def test_a_bos_written_twice_is_dropped_with_the_images_moved() -> None:
    prompt = ImagePrompt([1, 1, 5, *[FIRST.token] * 2, 6], (ImageSpan(3, 2, 2, FIRST.token),))
    once = without_first(prompt)
    assert once.tokens == [1, 5, FIRST.token, FIRST.token, 6]
    assert [(s.start, s.n_tokens) for s in once.images] == [(2, 2)]
