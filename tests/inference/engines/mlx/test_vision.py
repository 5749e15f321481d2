"""Images through the MLX engine in-process: mlx-vlm's processor and vision tower, mlx-lm's
language model reading the image's embeddings in place of its tokens, in one slot and in the
batch.

No real vision model runs here: the model is Gemma 3's architecture with random weights
(``harness/models/tiny_mlx_vision.py``), so what it "sees" means nothing. What is tested is
the path: the image's tokens in the prompt, an answer that depends on the image's pixels, the
prompt cache, the other sequences left alone, and the refusals.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from events.catalogue import TaskCreated
from events.records import SamplingParams
from harness.models.tiny_mlx_vision import IMAGE_TOKENS
from inference.decoding import Decoding, PromptCached, Token
from inference.engines.mlx.engine import MlxEngine
from inference.engines.mlx.vision import load_vision
from inference.job import Job, prepare
from structured.reply import InvalidRequest
from tests.images import checkers_png, gradient_png, image_chat

QUESTION = "What is in this image?"


@pytest.fixture(scope="module", params=[1, 2], ids=["one-slot", "batched"])
def seeing(request: pytest.FixtureRequest, tiny_mlx_vision: Path) -> Iterator[MlxEngine]:
    engine = MlxEngine(tiny_mlx_vision, n_ctx=512, slots=request.param)
    engine.load()
    yield engine
    engine.close()


def chat(
    data: bytes | None, text: str = QUESTION, at: int = 0
) -> tuple[TaskCreated, dict[str, bytes]]:
    return image_chat(data, text, at, max_tokens=6)


def prepared(engine: MlxEngine, data: bytes | None, **kwargs: object) -> Job:
    task, read = chat(data, **kwargs)  # type: ignore[arg-type]
    return prepare(engine, task, read)


def generated(engine: MlxEngine, job: Job, top: int | None = None) -> list[Token | PromptCached]:
    """What the engine gives, up to the task's ``max_tokens`` (one slot's generation goes on
    until its consumer stops, as the runner stops it)."""
    out: list[Token | PromptCached] = []
    for item in engine.generate(job.prompt, replace(job.decoding, top_logprobs=top)):
        if isinstance(item, Token | PromptCached):
            out.append(item)
        if len(tokens(out)) == job.decoding.params.max_tokens:
            break
    return out


def tokens(items: list[Token | PromptCached]) -> list[int]:
    return [i.id for i in items if isinstance(i, Token)]


def first(engine: MlxEngine, data: bytes) -> dict[int, float]:
    (token, *_) = [
        i for i in generated(engine, prepared(engine, data), top=5) if isinstance(i, Token)
    ]
    return dict(token.top)


def test_an_image_takes_its_tokens_where_the_template_puts_it(seeing: MlxEngine) -> None:
    job = prepared(seeing, gradient_png())
    (image,) = job.decoding.images
    assert (image.n_tokens, image.n_pos) == (IMAGE_TOKENS, IMAGE_TOKENS)
    assert job.prompt[image.start : image.end] == [image.token] * IMAGE_TOKENS
    assert image.token < 0  # no vocabulary's
    before = seeing.detokenize(job.prompt[: image.start])
    after = seeing.detokenize(job.prompt[image.end :])
    # Gemma 3's image sequence: its start and end tokens around the image's own.
    assert before.endswith("<start_of_turn>user\n\n\n<start_of_image>")
    assert after.startswith(f"<end_of_image>\n\n{QUESTION}<end_of_turn>")
    text_only = prepared(seeing, None)
    assert text_only.decoding.images == ()
    assert len(job.prompt) > len(text_only.prompt) + IMAGE_TOKENS
    last = prepared(seeing, gradient_png(), at=len(QUESTION))
    (image,) = last.decoding.images
    assert f"user\n{QUESTION}" in seeing.detokenize(last.prompt[: image.start])


def test_the_first_token_s_distribution_depends_on_the_image(seeing: MlxEngine) -> None:
    gradient, checkers = first(seeing, gradient_png()), first(seeing, checkers_png())
    assert gradient != pytest.approx(checkers, abs=1e-3)
    # The same image again (its prefix from the cache this time): the same distribution.
    assert first(seeing, gradient_png()) == pytest.approx(gradient, abs=1e-4)


def test_the_prompt_cache_goes_on_past_the_same_image_never_another(seeing: MlxEngine) -> None:
    job = prepared(seeing, gradient_png(64, 64))
    (image,) = job.decoding.images
    generated(seeing, job)
    again = generated(seeing, prepared(seeing, gradient_png(64, 64)))
    assert next(i.tokens for i in again if isinstance(i, PromptCached)) > image.end
    other = generated(seeing, prepared(seeing, checkers_png(64, 64)))
    assert next((i.tokens for i in other if isinstance(i, PromptCached)), 0) <= image.start


def test_an_image_leaves_the_other_sequences_as_they_were(seeing: MlxEngine) -> None:
    """A prompt with an image runs beside another sequence's generation: that one generates
    what it does alone."""
    text = prepared(seeing, None, text="Name three colours.")
    alone = tokens(generated(seeing, text))
    out: dict[str, list[int]] = {}

    def run(name: str, job: Job) -> None:
        out[name] = tokens(generated(seeing, job))

    threads = [
        threading.Thread(target=run, args=("text", text)),
        threading.Thread(target=run, args=("image", prepared(seeing, checkers_png()))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert out["text"] == alone and len(out["image"]) == 6


def test_refusals(seeing: MlxEngine, tiny_mlx: Path) -> None:
    task, read = chat(gradient_png())
    text_only = MlxEngine(tiny_mlx, n_ctx=256)
    text_only.load()
    with pytest.raises(InvalidRequest, match="its MLX weights hold no vision tower"):
        prepare(text_only, task, read)
    job = prepare(seeing, task, read)
    with pytest.raises(InvalidRequest, match="cannot be scored"):
        seeing.generate(job.prompt, replace(job.decoding, echo=True))
    with pytest.raises(InvalidRequest, match="holds <start_of_image>"):
        prepare(seeing, *chat(gradient_png(), text="<start_of_image> and this?"))
    (digest,) = read
    with pytest.raises(InvalidRequest, match="cannot be read"):
        prepare(seeing, task, {digest: b"not an image at all"})
    bare = Decoding(SamplingParams(), images=job.decoding.images)
    with pytest.raises(InvalidRequest, match="ends with an image"):
        seeing.generate(job.prompt[: job.decoding.images[0].end], bare)


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
