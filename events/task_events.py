"""The events of the work asked of the cluster: tasks (generation, embeddings) and the stored
responses of the Responses API. Part of the catalogue (``catalogue.py``), which importers use;
a task's chunks are ``chunk_events.py``'s.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from events.event_base import EventBase
from events.kinds import InstanceRole
from events.records import (
    ChatMessage,
    FinishReason,
    Id,
    ImageParams,
    Int32,
    PartRef,
    Record,
    ResponseFormat,
    SamplingParams,
    Timings,
    Tool,
    ToolChoice,
    Usage,
)
from events.states import ResponseStatus
from events.subjects import Aggregate

# --- tasks --------------------------------------------------------------------------------


class _TaskEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "task"
    # The model is in the subject so that runners pull only their model's tasks.
    subject_fields: ClassVar[tuple[str, ...]] = ("model_id", "task_id")
    task_id: Id
    model_id: Id


class Resume(Record):
    """A task taken up again after the runner serving it was lost: what it had generated (each
    stored chunk's token, from idx 0), so that the next runner goes on from there."""

    attempt: Annotated[int, Field(ge=1)] = Field(description="1 for the first resume, 2...")
    tokens: list[int] = Field(default_factory=list, description="Generated so far, in order.")
    runner_id: str | None = Field(default=None, description="The runner that was lost.")
    reason: str = ""


class TaskCreated(_TaskEvent):
    """A request for generation: chat messages or a plain prompt. Published again, with
    ``resume``, when its runner was lost mid-generation: the continuation."""

    kind: Literal["chat", "completion", "image"] = "chat"
    messages: list[ChatMessage] | None = None
    messages_ref: PartRef | None = Field(
        default=None,
        description="The chat's messages, stored as parts (bus/stores/parts.py); `messages` is then"
        " empty.",
    )
    prompt: str | None = None
    prompt_token_ids: list[int] | None = Field(
        default=None, description="A completion's prompt sent as token ids, not text."
    )
    params: SamplingParams = Field(default_factory=SamplingParams)
    image: ImageParams | None = Field(
        default=None,
        description="An image task's (kind `image`, its prompt in `prompt`): size, count, steps.",
    )
    user: str | None = Field(default=None, max_length=255)
    owner: str | None = Field(
        default=None, description="The API key (its key_id) that asked for it; None: no key."
    )
    keep_alive_s: float | None = Field(
        default=None,
        description="How long the model stays loaded once idle, from this task's end (Ollama's"
        " keep_alive; negative: for ever); None: as it was.",
    )
    tools: list[Tool] = Field(default_factory=list, description="Functions the model may call.")
    tools_ref: PartRef | None = Field(
        default=None, description="The tools, stored as parts; `tools` is then empty."
    )
    tool_choice: ToolChoice = Field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        default=None,
        description="Log-probabilities of the generated tokens, with this many alternatives"
        " each; None: none.",
    )
    echo: bool = Field(default=False, description="Score the prompt's tokens too (PromptScored).")
    thinking: bool | None = Field(
        default=None,
        description="Whether a thinking model thinks first: false turns it off where its chat"
        " template has a switch (`enable_thinking`); None: the template's default.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More variables for the chat template, as given."
    )
    thinking_budget: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="The most tokens a thinking model thinks: once spent, the runner ends the"
        " thinking itself (it makes the model write `</think>`) and the answer follows; None:"
        " as long as the model thinks.",
    )
    resume: Resume | None = Field(
        default=None, description="A continuation: where the lost runner had got to."
    )


class EmbeddingsRequested(_TaskEvent):
    """A request for embeddings of several inputs, for an embed instance's runners (its own
    type, so that chat runners of the same model, which pull ``TaskCreated``, never take it);
    with a ``query``, for relevance scores of the inputs to it, for a rerank instance's.
    Answered by ``EmbeddingsComputed`` on the chunk stream, then ``TaskCompleted``."""

    texts: list[str] | None = Field(default=None, description="The inputs as text.")
    query: str | None = Field(
        default=None,
        description="Reranking: score each text's relevance to this query (one score per"
        " text, by a rerank instance); None: embeddings.",
    )
    token_ids: list[list[int]] | None = Field(
        default=None, description="The inputs as token ids (when not sent as texts)."
    )
    dimensions: int | None = Field(
        default=None, ge=1, description="Keep this many leading dimensions, normalised; None: all."
    )
    truncate: bool = Field(
        default=False, description="Cut an input longer than the context short (Ollama's way)."
    )
    user: str | None = Field(default=None, max_length=255)
    owner: str | None = Field(default=None, description="The API key (key_id) that asked for it.")
    keep_alive_s: float | None = Field(
        default=None, description="As TaskCreated's: how long the model stays loaded once idle."
    )

    @property
    def role(self) -> InstanceRole:
        """The role of the instances that serve it."""
        return "embed" if self.query is None else "rerank"

    @property
    def kind(self) -> Literal["embedding", "rerank"]:
        """Its kind, as a task row names it (``events.kinds.role_of_task``)."""
        return "embedding" if self.query is None else "rerank"


class TaskStarted(_TaskEvent):
    """A runner took the task."""

    runner_id: Id
    instance_id: Id


class TaskCompleted(_TaskEvent):
    """Generation ended normally (stop or length), with usage and timings."""

    runner_id: Id
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    attempt: int | None = Field(
        default=None,
        ge=0,
        description="The attempt that ended: 0 the first run, n the n-th continuation; an older"
        " attempt's outcome does not end the task. None: logged before attempts were.",
    )


class TaskFailed(_TaskEvent):
    """The task could not be served; the error says why."""

    runner_id: str | None = None
    error: str
    attempt: int | None = Field(
        default=None,
        ge=0,
        description="The attempt that failed: 0 the first run, n the n-th continuation; an older"
        " attempt's failure does not end the task. None: logged before attempts were.",
    )
    prompt_tokens: Int32 | None = Field(
        default=None,
        ge=0,
        description="A prompt too long for the context: its tokens (None: another failure).",
    )
    context_length: Int32 | None = Field(
        default=None, ge=1, description="A prompt too long for the context: the context's tokens."
    )


class TaskCancelled(_TaskEvent):
    """The client gave up on the task (e.g. disconnected); runners stop generating."""

    reason: str = ""


class TaskForgotten(_TaskEvent):
    """An ended task the projection no longer keeps: it ended longer ago than the log keeps
    events (published by a planner, services/planner/janitor.py)."""

    reason: str = Field(default="expired", description="'expired': past the log's age limit.")


# --- responses ----------------------------------------------------------------------------

# Where a response of the Responses API stands (OpenAI's words).


class _ResponseEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "response"
    subject_fields: ClassVar[tuple[str, ...]] = ("response_id",)
    response_id: Id


class ResponseStored(_ResponseEvent):
    """A response of the Responses API (``POST /v1/responses`` with ``store``), as its client
    got it, or as it stands while it runs in the background; a later one replaces it. Any API
    process serves it from here, and continues it (``previous_response_id``)."""

    task_id: str = Field(default="", description="The task that made it.")
    model_id: str = ""
    owner: str | None = Field(default=None, description="The API key (key_id) that made it.")
    status: ResponseStatus = "completed"
    response: dict[str, Any] = Field(
        default_factory=dict, description="The response object, as the API answers it."
    )
    input_items: list[dict[str, Any]] = Field(
        default_factory=list, description="The request's input items, with their ids."
    )
    conversation: list[ChatMessage] = Field(
        default_factory=list,
        description="The conversation up to its output included (not its instructions): what"
        " a request that continues it starts from.",
    )
    input_items_ref: PartRef | None = Field(
        default=None, description="The input items, stored as parts; `input_items` is then empty."
    )
    conversation_ref: PartRef | None = Field(
        default=None,
        description="The conversation, stored as parts; `conversation` is then empty.",
    )
    expires_at: datetime | None = Field(
        default=None, description="When it is deleted unless deleted before (None: never)."
    )


class ResponseDeleted(_ResponseEvent):
    """A stored response was deleted: it is no longer served nor continued."""

    reason: str = Field(default="", description="'expired', or empty: asked for.")
