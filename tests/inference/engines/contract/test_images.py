"""Images on every engine that reads them: a chat's image where its template puts it, an
answer that depends on its pixels, the prompt cache going on past the same image and never
into another, the other sequences left alone, and the refusals; on one slot and batched.

No real vision model runs here: llama.cpp's is SmolLM2-135M-Instruct with a projector of
random weights made for it (``harness/models/tiny_projector.py``), MLX's Gemma 3's architecture
with random weights (``harness/models/tiny_mlx_vision.py``), so what they "see" means nothing.
What is tested is the path."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from events.catalogue import TaskCreated
from events.records import SamplingParams
from harness.images import checkers_png, gradient_png, image_chat
from harness.models import tiny_mlx_vision, tiny_projector
from inference.decoding import Decoding, PromptCached, Token
from inference.engines.base import Engine
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.engines.mlx.engine import MlxEngine
from inference.job import Job, prepare
from structured.reply import InvalidRequest
from tests.inference.engines.conftest import SMOLLM2_GGUF
from tests.inference.engines.contract.conftest import close

QUESTION = "What is in this image?"
MAX_TOKENS = 6


@dataclass(frozen=True)
class Model:
    """What differs between the engines' vision models."""

    image_tokens: int
    before: str  # how the text before a chat's first image ends
    after: str  # how the text after it starts
    around: bool  # the image's tokens have start and end tokens of their own around them
    marker: str  # the image placeholder a message may not hold
    no_images: str  # why a model without a vision part reads none
    unreadable: str  # what is said of bytes that are no image
    # The prompt cache holds every token it ran: the same image's prompt again runs its last
    # token only, another image's from where the image starts (MLX's keeps less, in steps).
    whole_cache: bool


MODELS = {
    "llamacpp": Model(
        tiny_projector.IMAGE_TOKENS,
        "<|im_start|>user\n",
        f"{QUESTION}<|im_end|>",
        False,
        "<__media__>",
        "not read images: its model has no projector",
        "could not decode image 1",
        True,
    ),
    "mlx": Model(
        tiny_mlx_vision.IMAGE_TOKENS,
        "<start_of_turn>user\n\n\n<start_of_image>",
        f"<end_of_image>\n\n{QUESTION}<end_of_turn>",
        True,
        "<start_of_image>",
        "its MLX weights hold no vision tower",
        "cannot be read",
        False,
    ),
}


@pytest.fixture(scope="module", params=[1, 2], ids=["one-slot", "batched"])
def seeing(engine_kind: str, request: pytest.FixtureRequest) -> Iterator[Engine]:
    made: Engine
    if engine_kind == "llamacpp" and request.param == 1:
        pytest.skip("llama.cpp serves one slot with the batch decoder of several: as batched")
    if engine_kind == "llamacpp":
        projector: Path = request.getfixturevalue("tiny_projector")
        made = LlamaCppEngine(
            SMOLLM2_GGUF, n_ctx=512, slots=request.param, n_threads=1, projector=projector
        )
    else:
        folder: Path = request.getfixturevalue("tiny_mlx_vision")
        made = MlxEngine(folder, n_ctx=512, slots=request.param)
    made.load()
    yield made
    close(made)


@pytest.fixture
def model(engine_kind: str) -> Model:
    return MODELS[engine_kind]


def chat(
    data: bytes | None, text: str = QUESTION, at: int = 0
) -> tuple[TaskCreated, dict[str, bytes]]:
    return image_chat(data, text, at, max_tokens=MAX_TOKENS)


def prepared(engine: Engine, data: bytes | None, **kwargs: object) -> Job:
    task, read = chat(data, **kwargs)  # type: ignore[arg-type]
    return prepare(engine, task, read)


def generated(engine: Engine, job: Job, top: int | None = None) -> list[Token | PromptCached]:
    """What the engine gives, up to the task's ``max_tokens`` (an engine may go on until its
    consumer stops, as the runner stops it)."""
    out: list[Token | PromptCached] = []
    for item in engine.generate(job.prompt, replace(job.decoding, top_logprobs=top)):
        if isinstance(item, Token | PromptCached):
            out.append(item)
        if len(tokens(out)) == job.decoding.params.max_tokens:
            break
    return out


def tokens(items: list[Token | PromptCached]) -> list[int]:
    return [i.id for i in items if isinstance(i, Token)]


def cached(items: list[Token | PromptCached]) -> int:
    return next((i.tokens for i in items if isinstance(i, PromptCached)), 0)


def first(engine: Engine, data: bytes) -> dict[int, float]:
    (token, *_) = [
        i for i in generated(engine, prepared(engine, data), top=5) if isinstance(i, Token)
    ]
    return dict(token.top)


def forget(engine: Engine) -> None:
    if isinstance(engine, LlamaCppEngine):
        engine.drop_cache()


def test_an_image_takes_its_tokens_where_the_template_puts_it(seeing: Engine, model: Model) -> None:
    job = prepared(seeing, gradient_png())
    (image,) = job.decoding.images
    assert (image.n_tokens, image.n_pos) == (model.image_tokens, model.image_tokens)
    assert job.prompt[image.start : image.end] == [image.token] * model.image_tokens
    assert image.token < 0  # no vocabulary's
    before = seeing.detokenize(job.prompt[: image.start])
    after = seeing.detokenize(job.prompt[image.end :])
    assert before.endswith(model.before) and after.startswith(model.after)
    # The same chat without the image: its tokens fewer (and its start and end tokens), the
    # same text.
    text_only = prepared(seeing, None)
    assert text_only.decoding.images == ()
    if model.around:
        assert len(job.prompt) > len(text_only.prompt) + model.image_tokens
    else:
        assert len(job.prompt) == len(text_only.prompt) + model.image_tokens
    # After the text, the image comes after it.
    last = prepared(seeing, gradient_png(), at=len(QUESTION))
    (image,) = last.decoding.images
    before = seeing.detokenize(last.prompt[: image.start])
    assert f"user\n{QUESTION}" in before
    if not model.around:
        assert before.endswith(f"user\n{QUESTION}")
        assert seeing.detokenize(last.prompt[image.end :]).startswith("<|im_end|>")


def test_the_first_token_s_distribution_depends_on_the_image(seeing: Engine) -> None:
    forget(seeing)
    gradient, checkers = first(seeing, gradient_png()), first(seeing, checkers_png())
    assert gradient != pytest.approx(checkers, abs=1e-3)
    # The same image again (its prefix from the cache this time): the same distribution.
    assert first(seeing, gradient_png()) == pytest.approx(gradient, abs=1e-4)


def test_the_prompt_cache_goes_on_past_the_same_image_never_another(
    seeing: Engine, model: Model
) -> None:
    forget(seeing)
    job = prepared(seeing, gradient_png(64, 64))
    (image,) = job.decoding.images
    first = cached(generated(seeing, job))
    # The same image: past it (all but the last token, which runs for its logits).
    again = cached(generated(seeing, prepared(seeing, gradient_png(64, 64))))
    assert again > image.end
    # Another image: up to where the image starts, never into it.
    other = cached(generated(seeing, prepared(seeing, checkers_png(64, 64))))
    assert other <= image.start
    if model.whole_cache:
        assert (first, again, other) == (0, len(job.prompt) - 1, image.start)


def test_an_image_leaves_the_other_sequences_as_they_were(seeing: Engine) -> None:
    """A prompt with an image runs beside another sequence's generation (on its own sequence,
    in the batch): that one generates what it does alone."""
    text = prepared(seeing, None, text="Name three colours.")
    forget(seeing)
    alone = tokens(generated(seeing, text))
    forget(seeing)
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
    assert out["text"] == alone and len(out["image"]) == MAX_TOKENS


def test_refusals(seeing: Engine, engine: Engine, model: Model) -> None:
    task, read = chat(gradient_png())
    with pytest.raises(InvalidRequest, match=model.no_images):
        prepare(engine, task, read)  # the contract's engine: no vision part
    job = prepare(seeing, task, read)
    with pytest.raises(InvalidRequest, match="cannot be scored"):
        seeing.generate(job.prompt, replace(job.decoding, echo=True))
    with pytest.raises(InvalidRequest, match=f"holds {model.marker}"):
        prepare(seeing, *chat(gradient_png(), text=f"{model.marker} and this?"))
    (digest,) = read
    with pytest.raises(InvalidRequest, match=model.unreadable):
        prepare(seeing, task, {digest: b"not an image at all"})
    bare = Decoding(SamplingParams(), images=job.decoding.images)
    with pytest.raises(InvalidRequest, match="ends with an image"):
        seeing.generate(job.prompt[: job.decoding.images[0].end], bare)
