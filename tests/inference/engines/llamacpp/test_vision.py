"""Images through the llama.cpp engine in-process (libmtmd): a chat's image where its template
puts it, evaluated on its own sequence, the text and the generation in the shared batch.

No real vision model runs here: the model is SmolLM2-135M-Instruct with a projector of random
weights made for it (``tests/vision.py``), so what it "sees" means nothing. What is tested is
the path: the image's 64 tokens in the prompt, an answer that depends on the image's pixels,
the prompt cache, the other sequences left alone, and the refusals.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from events.catalogue import TaskCreated
from events.records import SamplingParams
from inference.decoding import Decoding, PromptCached, Token
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.engines.llamacpp.vision import projector_on_gpu
from inference.job import Job, prepare
from structured.reply import InvalidRequest
from tests.images import checkers_png, gradient_png, image_chat
from tests.templated import SMOLLM2
from tests.vision import IMAGE_TOKENS

QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def seeing(tiny_projector: Path) -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(SMOLLM2, n_ctx=512, slots=2, n_threads=1, projector=tiny_projector)
    engine.load()
    yield engine
    engine.close()


def chat(
    data: bytes | None, text: str = QUESTION, at: int = 0
) -> tuple[TaskCreated, dict[str, bytes]]:
    return image_chat(data, text, at, max_tokens=8)


def prepared(engine: LlamaCppEngine, data: bytes | None, **kwargs: object) -> Job:
    task, read = chat(data, **kwargs)  # type: ignore[arg-type]
    return prepare(engine, task, read)


def generated(
    engine: LlamaCppEngine, job: Job, top: int | None = None
) -> list[Token | PromptCached]:
    d = replace(job.decoding, top_logprobs=top)
    return [i for i in engine.generate(job.prompt, d) if isinstance(i, Token | PromptCached)]


def tokens(items: list[Token | PromptCached]) -> list[int]:
    return [i.id for i in items if isinstance(i, Token)]


def cached(items: list[Token | PromptCached]) -> int:
    return next((i.tokens for i in items if isinstance(i, PromptCached)), 0)


def test_an_image_takes_its_tokens_where_the_template_puts_it(seeing: LlamaCppEngine) -> None:
    job = prepared(seeing, gradient_png())
    (image,) = job.decoding.images
    assert (image.n_tokens, image.n_pos) == (IMAGE_TOKENS, IMAGE_TOKENS)
    assert job.prompt[image.start : image.end] == [image.token] * IMAGE_TOKENS
    assert image.token < 0  # no vocabulary's
    before = seeing.detokenize(job.prompt[: image.start])
    after = seeing.detokenize(job.prompt[image.end :])
    assert before.endswith("<|im_start|>user\n") and after.startswith(f"{QUESTION}<|im_end|>")
    # The same chat without the image: 64 tokens fewer, the same text.
    text_only = prepared(seeing, None)
    assert len(job.prompt) == len(text_only.prompt) + IMAGE_TOKENS
    assert text_only.decoding.images == ()
    # After the text, the image comes after it.
    last = prepared(seeing, gradient_png(), at=len(QUESTION))
    (image,) = last.decoding.images
    assert seeing.detokenize(last.prompt[: image.start]).endswith(f"user\n{QUESTION}")
    assert seeing.detokenize(last.prompt[image.end :]).startswith("<|im_end|>")


def test_the_first_token_s_distribution_depends_on_the_image(seeing: LlamaCppEngine) -> None:
    seeing.drop_cache()
    first = {}
    for name, data in (("gradient", gradient_png()), ("checkers", checkers_png())):
        (token, *_) = [
            i for i in generated(seeing, prepared(seeing, data), top=5) if isinstance(i, Token)
        ]
        first[name] = dict(token.top)
    assert first["gradient"] != pytest.approx(first["checkers"], abs=1e-3)
    # The same image again (its prefix from the cache this time): the same distribution.
    (again, *_) = [
        i
        for i in generated(seeing, prepared(seeing, gradient_png()), top=5)
        if isinstance(i, Token)
    ]
    assert dict(again.top) == pytest.approx(first["gradient"], abs=1e-4)


def test_the_prompt_cache_goes_on_past_the_same_image_never_another(
    seeing: LlamaCppEngine,
) -> None:
    seeing.drop_cache()
    job = prepared(seeing, gradient_png())
    (image,) = job.decoding.images
    assert cached(generated(seeing, job)) == 0
    # The same image: all but the last token (which runs for its logits).
    assert cached(generated(seeing, prepared(seeing, gradient_png()))) == len(job.prompt) - 1
    # Another image: up to where the image starts, never into it.
    assert cached(generated(seeing, prepared(seeing, checkers_png()))) == image.start


def test_an_image_leaves_the_other_sequences_as_they_were(seeing: LlamaCppEngine) -> None:
    """The image is evaluated on its own sequence while another sequence generates: that one
    generates what it does alone."""
    text = prepared(seeing, None, text="Name three colours.")
    seeing.drop_cache()
    alone = tokens(generated(seeing, text))
    seeing.drop_cache()
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
    assert out["text"] == alone and len(out["image"]) == 8


def test_refusals(seeing: LlamaCppEngine) -> None:
    task, read = chat(gradient_png())
    text_only = LlamaCppEngine(SMOLLM2, n_ctx=256, n_threads=1)
    text_only.load()
    try:
        with pytest.raises(InvalidRequest, match="not read images: its model has no projector"):
            prepare(text_only, task, read)
    finally:
        text_only.close()
    job = prepare(seeing, task, read)
    with pytest.raises(InvalidRequest, match="cannot be scored"):
        seeing.generate(job.prompt, replace(job.decoding, echo=True))
    with pytest.raises(InvalidRequest, match="holds <__media__>"):
        prepare(seeing, *chat(gradient_png(), text="<__media__> and this?"))
    (digest,) = read
    with pytest.raises(InvalidRequest, match="could not decode image 1"):
        prepare(seeing, task, {digest: b"not an image at all"})
    bare = Decoding(SamplingParams(), images=job.decoding.images)
    with pytest.raises(InvalidRequest, match="ends with an image"):
        seeing.generate(job.prompt[: job.decoding.images[0].end], bare)


def test_the_projector_goes_where_the_model_s_layers_are() -> None:
    assert not projector_on_gpu({"n_gpu_layers": 0, "split_mode": 0, "main_gpu": -1})
    assert projector_on_gpu({"n_gpu_layers": 31, "split_mode": 0, "main_gpu": 0})
    assert projector_on_gpu({"n_gpu_layers": 10, "split_mode": 1, "main_gpu": 0})  # some in RAM
    assert not projector_on_gpu({})  # Llama's defaults: the CPU
