"""The events a task's runner streams to whoever waits for its answer (tokens, prompt scores,
embeddings, an image task's steps and images): on the chunk stream,
``shoal.chunks.<task_id>``, not on the event stream. Part of the catalogue
(``events/catalogue.py``'s ``Event``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from events.event_base import EventBase
from events.records import FinishReason, Id, ImagePart, TokenLogprob, ToolCallDelta
from events.subjects import Aggregate


class _ChunkStreamEvent(EventBase):
    """What a task's runner streams to whoever waits for its answer: on the chunk stream, one
    subject a task (``shoal.chunks.<task_id>``), not on the event stream."""

    aggregate: ClassVar[Aggregate] = "chunk"
    subject_fields: ClassVar[tuple[str, ...]] = ("task_id",)
    on_chunk_stream: ClassVar[bool] = True
    task_id: Id


class ChunkGenerated(_ChunkStreamEvent):
    """One generated token. Lives on the chunk stream, not the event stream."""

    idx: int = Field(description="0, 1, 2... in generation order.")
    text: str = Field(description="The reply's text (a tool call's text is in tool_calls).")
    reasoning: str = Field(
        default="", description="A thinking model's thinking, apart from the reply's text."
    )
    token_id: int | None = None
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = Field(default=None, description="When the task asked.")
    tool_calls: tuple[ToolCallDelta, ...] = ()
    stop_sequence: str | None = Field(
        default=None, description="On the last chunk: the stop sequence that ended the task."
    )
    attempt: int | None = Field(
        default=None,
        ge=0,
        description="The attempt that made it: 0 the first run, n the n-th continuation"
        " (`resume.attempt`); only the newest attempt's chunks count (events/attempts.py)."
        " None: logged before attempts were.",
    )
    # Known before the outcome's usage, for Anthropic's message_start.
    prompt_tokens: int | None = Field(
        None, ge=0, description="On the first chunk an attempt publishes: the prompt's tokens."
    )
    cached_tokens: int | None = Field(
        None, ge=0, description="With `prompt_tokens`: those of them the runner's cache held."
    )


class PromptScored(_ChunkStreamEvent):
    """Log-probabilities of a slice of a task's prompt tokens (a task with ``echo``), published
    before its first chunk, on the chunk stream."""

    start: int = Field(description="The position in the prompt of the first token here.")
    total: int = Field(description="Tokens in the whole prompt.")
    tokens: tuple[TokenLogprob, ...]
    attempt: int | None = Field(
        default=None,
        ge=0,
        description="The attempt that scored it (0 the first run). None: logged before attempts"
        " were.",
    )


class EmbeddingsComputed(_ChunkStreamEvent):
    """The vectors of a slice of an embeddings task's inputs, L2-normalised, as base64 of
    float32 little-endian (``events.vectors``), one row of ``dimensions`` after the other: 64
    vectors of 576 dimensions are 197 KB, far below a NATS message's 1 MiB, and larger answers
    come in several slices. Published before the task's ``TaskCompleted``. A rerank task's
    (one with a ``query``) are its scores: one float per input, not normalised."""

    start: int = Field(description="The index of this slice's first input.")
    total: int = Field(description="Inputs in the whole task.")
    dimensions: int = Field(description="Floats per vector.")
    vectors: str = Field(description="base64 of float32 little-endian, vector after vector.")


class ImageStepped(_ChunkStreamEvent):
    """An image task's progress: image ``image`` (0-based) of ``images`` has had ``step`` of its
    ``steps`` denoising steps. One per step, so that the log shows the task moving."""

    image: int = Field(ge=0)
    images: int = Field(ge=1)
    step: int = Field(ge=1)
    steps: int = Field(ge=1)
    attempt: int | None = Field(default=None, ge=0, description="As ChunkGenerated's.")


class ImageGenerated(_ChunkStreamEvent):
    """An image an image task made: a finished one (``partial`` None) or a partial one (the
    image so far, ``partial`` 0, 1... in order). Its bytes are stored by digest as prompt
    parts are (``bus/stores/images.py``); ``png`` names them, never holds them."""

    index: int = Field(ge=0, description="Which of the task's images.")
    partial: int | None = Field(default=None, ge=0, description="None: the finished image.")
    png: ImagePart = Field(description="The PNG's digest, size and stored parts.")
    seed: int | None = Field(default=None, description="The seed it was drawn with.")
    attempt: int | None = Field(default=None, ge=0, description="As ChunkGenerated's.")
