"""What the MLX engine's vision side does beyond every engine's contract
(``contract/test_images.py``): a prompt's rows are the same however it is cut (on the tiny
random-weight Gemma 3 in mlx-vlm's layout)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from events.catalogue import TaskCreated
from harness.images import gradient_png, image_chat
from inference.engines.mlx.engine import MlxEngine
from inference.engines.mlx.vision import load_vision
from inference.job import prepare

QUESTION = "What is in this image?"


def chat(
    data: bytes | None, text: str = QUESTION, at: int = 0
) -> tuple[TaskCreated, dict[str, bytes]]:
    return image_chat(data, text, at, max_tokens=6)


def test_a_prompt_s_rows_are_the_same_however_it_is_cut(tiny_mlx_vision: Path) -> None:
    """A chunk boundary or a cached prefix may fall inside an image: its rows are sliced from
    the image's, so the prompt's rows cut anywhere are its rows whole."""
    engine = MlxEngine(tiny_mlx_vision, n_ctx=512)
    engine.load()
    vision = load_vision(tiny_mlx_vision, engine.model)[0]
    assert vision is not None and vision.marker == "<start_of_image>"
    job = prepare(engine, *chat(gradient_png(), text="Compare", at=3))
    prompt, spans = job.prompt, job.decoding.images
    whole = vision.embeddings(prompt, spans, 0, len(prompt))
    assert whole.shape[:2] == (1, len(prompt))
    (image,) = spans
    for cut in (image.start, image.start + 1, image.end - 1, image.end):
        parts = [
            vision.embeddings(prompt, spans, 0, cut),
            vision.embeddings(prompt, spans, cut, len(prompt)),
        ]
        assert mx.array_equal(mx.concatenate(parts, axis=1), whole)
    # The text rows are the token embedding's, the image's are not.
    text = vision.embeddings([max(t, 0) for t in prompt], (), 0, len(prompt))
    assert mx.array_equal(text[:, : image.start], whole[:, : image.start])
    assert not mx.allclose(text[:, image.start : image.end], whole[:, image.start : image.end])
