"""The event catalogue: every fact Shoal records, as frozen pydantic models.

One model per event type, discriminated by ``type``. Events are JSON on the wire so that
``nats sub 'shoal.events.>'`` shows readable text. An event is never edited: a new field gets a
default, a changed meaning gets a new type or a new ``v``. Unknown extra fields are ignored, so
an older consumer still reads a newer producer's events.

What every event is (its type, id, time, subjects) is ``bus/event_base.py``; the events of the
chunk stream (tokens, prompt scores, embeddings) are ``bus/chunk_events.py``. This module holds
the others and the union of all, ``Event``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import ConfigDict, Field, TypeAdapter

from bus.chunk_events import ChunkGenerated as ChunkGenerated
from bus.chunk_events import EmbeddingsComputed as EmbeddingsComputed
from bus.chunk_events import PromptScored as PromptScored
from bus.event_base import SCHEMA_VERSION as SCHEMA_VERSION
from bus.event_base import EventBase as EventBase
from bus.event_base import new_id as new_id
from bus.event_base import utc_now as utc_now
from bus.kinds import DEFAULT_ENGINE, Engine, InstanceRole, KeyRole
from bus.records import (
    ChatMessage,
    FinishReason,
    Id,
    Int32,
    NodeProfile,
    PartRef,
    Record,
    ResponseFormat,
    SamplingParams,
    ShardAssignment,
    Timings,
    Tool,
    ToolChoice,
    Usage,
)
from bus.records import WeightFile as WeightFile
from bus.states import ResponseStatus, RunnerState
from bus.subjects import Aggregate

# --- nodes --------------------------------------------------------------------------------


class _NodeEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "node"
    subject_fields: ClassVar[tuple[str, ...]] = ("node_id",)
    node_id: Id


class NodeJoined(_NodeEvent):
    """A worker started on a machine and joined the cluster."""

    hostname: str = ""
    addresses: list[str] = Field(default_factory=list, description="Data-plane addresses.")
    version: str = ""
    heartbeat_s: float | None = Field(
        default=None, description="Seconds between its ResourceProfiled heartbeats."
    )
    advertised: str = Field(
        default="",
        description="The address other nodes reach this one's pipeline stages and weights at.",
    )
    advertised_why: str = Field(default="", description="Why that address was chosen.")


class NodeLeft(_NodeEvent):
    """A worker stopped cleanly."""

    reason: str = "shutdown"


class NodeTimedOut(_NodeEvent):
    """A node's heartbeats stopped; decided by a planner."""

    last_seen: datetime
    missed_heartbeats: int


class ResourceProfiled(_NodeEvent):
    """The node's resources; sent periodically, so it is also the heartbeat."""

    profile: NodeProfile


# --- models -------------------------------------------------------------------------------


class ModelAdded(EventBase):
    """A model became known to the cluster, with what placement needs to know."""

    aggregate: ClassVar[Aggregate] = "model"
    subject_fields: ClassVar[tuple[str, ...]] = ("model_id",)
    model_id: Id
    family: str = ""
    n_layers: int
    context_length: int = 0
    size_bytes: int
    engines: list[Engine] = Field(default_factory=lambda: [DEFAULT_ENGINE])
    chat_format: str | None = None
    source: str = Field(default="", description="Where the weights come from (package, repo).")
    path: str | None = Field(
        default=None,
        description="The weights on the disk of `node_id` (or of every node, in"
        " a log from before `files`): a GGUF file or an MLX directory.",
    )
    kv_bytes_per_token: int = Field(
        default=0, description="KV cache per token of context, all layers (f16)."
    )
    overhead_bytes: int = Field(
        default=0, description="Engine memory beyond weights and KV cache, per runner."
    )
    files: list[WeightFile] = Field(
        default_factory=list,
        description="The weights, by content: each node that runs a shard of the model takes"
        " what it needs from a node that holds them, else from the models bucket. Empty: they"
        " are at `path` (added with --local, or before the bucket).",
    )
    node_id: str | None = Field(
        default=None,
        description="The node whose disk holds `path` (added with --local): the only one that"
        " serves the model. None: any node.",
    )
    vision: bool = Field(
        default=False,
        description="An MLX model that reads images (its directory holds a vision tower, read"
        " with mlx-vlm). A GGUF model reads them when one of its `files` is a projector.",
    )


class ModelRemoved(EventBase):
    """A model the cluster knew is no longer known (``shoal models remove``, Ollama's DELETE),
    asked for when no live instance used it. The objects of the models bucket that no other
    model names go with it; it may be added again."""

    aggregate: ClassVar[Aggregate] = "model"
    subject_fields: ClassVar[tuple[str, ...]] = ("model_id",)
    model_id: Id
    reason: str = Field(default="", description="Who asked: the command or the API route.")


class ModelEvicted(EventBase):
    """A node's worker deleted a model's files from its weights cache to stay within the
    cache's size budget (the model stays known: a runner fetches them again if it needs
    them)."""

    aggregate: ClassVar[Aggregate] = "node"
    subject_fields: ClassVar[tuple[str, ...]] = ("node_id", "model_id")
    node_id: Id
    model_id: Id
    bytes_freed: int = Field(
        ge=0, description="Bytes of the cache's own copies deleted (links to files cost none)."
    )
    budget_bytes: int = Field(ge=0, description="The cache's size budget.")
    reason: str = Field(default="", description="What the room was made for.")


# --- instances ----------------------------------------------------------------------------


class _InstanceEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "instance"
    subject_fields: ClassVar[tuple[str, ...]] = ("instance_id",)
    instance_id: Id


class InstanceRequested(_InstanceEvent):
    """Someone asked for a model to be served."""

    model_id: Id
    placement: str | None = Field(default=None, description="Manual placement spec (JSON).")
    replicas: Int32 = 1
    context_length: Int32 | None = None
    slots: Int32 | None = Field(
        default=None,
        description="Tasks each replica serves at once (a KV cache of context_length each);"
        " None: as many as fit, up to 8, chosen at placement.",
    )
    role: InstanceRole = "chat"
    aliases: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        description="Other names clients may call the model by (an SDK's own model names).",
    )
    on_demand: bool = Field(
        default=False,
        description="Asked for by a request for a model nothing served: unloaded once idle"
        " past its keep-alive, or to make room. False: pinned (asked for explicitly).",
    )
    keep_alive_s: float | None = Field(
        default=None,
        description="An on-demand instance's seconds idle before it is unloaded (negative:"
        " never); None: the planner's default.",
    )
    reason: str = Field(default="", description="Why it was asked for (the request's route).")


class InstancePlaced(_InstanceEvent):
    """A planner decided where an instance's shards run. A later one replaces the earlier."""

    model_id: Id
    shards: list[ShardAssignment]
    generation: int | None = Field(
        default=None,
        description="The instance's decision number (1, 2...); a decision for a generation"
        " that is no longer next is ignored, so two planners never both count.",
    )
    reason: str = Field(default="", description="Why it was placed again, when it was.")
    avoid: list[str] = Field(
        default_factory=list, description="'node:device's its runners kept failing on."
    )
    slots: Int32 | None = Field(
        default=None,
        description="Tasks each replica serves at once, as placed (memory counted for the KV"
        " cache of each); None (older logs): 1.",
    )


class PlacementRejected(_InstanceEvent):
    """A planner found no way to place an instance; the reason says what was missing."""

    model_id: Id
    reason: str
    needed_bytes: int | None = None
    available_bytes: dict[str, int] = Field(
        default_factory=dict, description="Usable bytes per 'node:device'."
    )
    generation: int | None = Field(default=None, description="As in InstancePlaced.")
    avoid: list[str] = Field(default_factory=list, description="As in InstancePlaced.")


class InstanceDeleteRequested(_InstanceEvent):
    """Someone asked for an instance to stop being served."""

    reason: str = ""


class InstanceDeleted(_InstanceEvent):
    """An instance is gone; its runners stop."""

    reason: str = ""


# --- runners ------------------------------------------------------------------------------


class RunnerStateChanged(EventBase):
    """A runner process (one shard) changed state."""

    aggregate: ClassVar[Aggregate] = "runner"
    subject_fields: ClassVar[tuple[str, ...]] = ("runner_id",)
    runner_id: Id
    instance_id: Id
    node_id: Id
    state: RunnerState
    progress: float | None = Field(default=None, description="0-1 while Downloading/Loading.")
    error: str | None = None
    exit_code: int | None = None
    endpoint: str | None = Field(default=None, description="Data-plane endpoint (host:port).")
    pid: int | None = None
    slots: Int32 | None = Field(
        default=None, description="On Ready: how many tasks the runner serves at once."
    )


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

    kind: Literal["chat", "completion"] = "chat"
    messages: list[ChatMessage] | None = None
    messages_ref: PartRef | None = Field(
        default=None,
        description="The chat's messages, stored as parts (bus/parts.py); `messages` is then"
        " empty.",
    )
    prompt: str | None = None
    prompt_token_ids: list[int] | None = Field(
        default=None, description="A completion's prompt sent as token ids, not text."
    )
    params: SamplingParams = Field(default_factory=SamplingParams)
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
        """Its kind, as a task row names it (``bus.kinds.role_of_task``)."""
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


# --- API keys -----------------------------------------------------------------------------


class _KeyEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "key"
    subject_fields: ClassVar[tuple[str, ...]] = ("key_id",)
    key_id: Id


class KeyAdded(_KeyEvent):
    """An API key was made (``shoal keys add``). The key itself is never on the log: only its
    digest, which the API compares with a digest of the key a request sends."""

    name: Annotated[str, Field(min_length=1, max_length=100)]
    role: KeyRole = "user"
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, hex.")
    requests_per_minute: Int32 | None = Field(
        default=None, description="The most requests it may make in a minute (None: any)."
    )
    tokens_per_minute: Int32 | None = Field(
        default=None, description="The most tokens (prompt and generated) in a minute."
    )


class KeyRevoked(_KeyEvent):
    """An API key no longer opens anything."""

    reason: str = ""


# --- the log itself -----------------------------------------------------------------------


class LogTailLost(EventBase):
    """The log went back behind a reader: events it had read are gone (a nats-server's
    unsynced writes lost to a power cut, a store restored from a copy), and newer ones may have
    taken their numbers. The projector that noticed it rebuilt its projection from what the
    log still holds (docs/operations.md, "Power cuts and crashes")."""

    aggregate: ClassVar[Aggregate] = "log"
    subject_fields: ClassVar[tuple[str, ...]] = ("stream",)
    stream: Id = Field(default="SHOAL_EVENTS", description="The stream that went back.")
    reader: str = Field(default="", description="Who noticed it: 'projector:<name>'.")
    tracking_seq: int = Field(default=0, description="Where the reader stood: its last event.")
    stream_last_seq: int = Field(default=0, description="The stream's last sequence then.")
    dropped: str = Field(default="", description="What the log lost, for people.")
    rebuilt_from_seq: int = Field(
        default=0,
        description="The snapshot the projection was rebuilt from (0: from the log's start).",
    )


Event = Annotated[
    NodeJoined
    | NodeLeft
    | NodeTimedOut
    | ResourceProfiled
    | ModelAdded
    | ModelRemoved
    | ModelEvicted
    | InstanceRequested
    | InstancePlaced
    | PlacementRejected
    | InstanceDeleteRequested
    | InstanceDeleted
    | RunnerStateChanged
    | TaskCreated
    | EmbeddingsRequested
    | TaskStarted
    | ChunkGenerated
    | PromptScored
    | EmbeddingsComputed
    | TaskCompleted
    | TaskFailed
    | TaskCancelled
    | TaskForgotten
    | ResponseStored
    | ResponseDeleted
    | KeyAdded
    | KeyRevoked
    | LogTailLost,
    Field(discriminator="type"),
]

# The catalogue, in the union's order: the union is the one list of event types.
EVENT_TYPES: tuple[type[EventBase], ...] = get_args(get_args(Event)[0])


def event_type_filters() -> dict[str, str]:
    """Event type -> the subject filter matching exactly its events on SHOAL_EVENTS
    (``shoal.events.task.*.*.TaskCreated``); types on the chunk stream have none."""
    return {t.__name__: t.filter_for() for t in EVENT_TYPES if not t.on_chunk_stream}


_FILTER_TOKENS = {name: f.split(".") for name, f in event_type_filters().items()}


def subject_event_type(subject: str) -> str | None:
    """The event type a subject of SHOAL_EVENTS names (its filter matches), or None: what the
    log holds counted by type, malformed events included, without parsing them."""
    tokens = subject.split(".")
    pattern = _FILTER_TOKENS.get(tokens[-1])
    if pattern is None or len(pattern) != len(tokens):
        return None
    if any(p != "*" and p != t for p, t in zip(pattern, tokens, strict=True)):
        return None
    return tokens[-1]


# Keys only: pydantic's default also keeps short string values (ids, timestamps) in a
# process-wide cache, which every event's new ids churn for no hit, and which a long-running
# process carried as growth (bench/soak.py).
_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event, config=ConfigDict(cache_strings="keys"))


def parse_event(data: bytes | str) -> Event:
    """Parse one event from JSON; raises pydantic.ValidationError on anything malformed."""
    return _ADAPTER.validate_json(data)


def chunk_stream_type(data: bytes) -> str:
    """The type of an event on the chunk stream, whose subjects do not name it (for feeds that
    show events without parsing them)."""
    head = data[:400]
    for kind, marker in _CHUNK_TYPE_MARKERS:
        if marker in head:
            return kind
    return ChunkGenerated.__name__


_CHUNK_TYPE_MARKERS = tuple(
    (t.__name__, f'"type":"{t.__name__}"'.encode()) for t in (PromptScored, EmbeddingsComputed)
)
