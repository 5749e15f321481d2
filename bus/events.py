"""The event catalogue: every fact Shoal records, as frozen pydantic models.

One model per event type, discriminated by ``type``. Events are JSON on the wire so that
``nats sub 'shoal.events.>'`` shows readable text. An event is never edited: a new field gets a
default, a changed meaning gets a new type or a new ``v``. Unknown extra fields are ignored, so
an older consumer still reads a newer producer's events.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, cast, get_args

from pydantic import Field, TypeAdapter

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
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolChoice,
    Usage,
)
from bus.states import ResponseStatus, RunnerState
from bus.subjects import (
    CHUNKS_PREFIX,
    EVENTS_PREFIX,
    Aggregate,
    chunk_subject,
    event_subject,
    event_type_filter,
)

SCHEMA_VERSION = 1


def new_id() -> str:
    return uuid.uuid4().hex


def utc_now() -> datetime:
    return datetime.now(UTC)


class EventBase(Record):
    """Every event. A concrete event is a class whose name does not start with ``_``: its
    name is its ``type``, written once (``__init_subclass__`` makes the field a Literal of it,
    which the discriminated union ``Event`` needs)."""

    aggregate: ClassVar[Aggregate]
    # The fields whose values name the subject, after the aggregate.
    subject_fields: ClassVar[tuple[str, ...]]
    # Token chunks and prompt scores live on the chunk stream, everything else on the events'.
    on_chunk_stream: ClassVar[bool] = False

    type: str = Field(default="", description="The event type: its class's name.")
    event_id: str = Field(default_factory=new_id, description="Unique id; the default Nats-Msg-Id.")
    ts: datetime = Field(default_factory=utc_now, description="When the fact happened (UTC).")
    origin: str = Field(description="Node id (or service name) that published the event.")
    v: int = Field(default=SCHEMA_VERSION, description="Schema version of this event type.")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if not cls.__name__.startswith("_"):
            # Before pydantic collects the fields (it does once this returns).
            cls.__annotations__["type"] = cast(Any, Literal)[cls.__name__]
            cls.type = cls.__name__
        super().__init_subclass__(**kwargs)

    @property
    def subject(self) -> str:
        return self.subject_for(*(str(getattr(self, f)) for f in self.subject_fields))

    @classmethod
    def subject_for(cls, *ids: str) -> str:
        """The subject of this type's event about ``ids``, its ``subject_fields`` in order:
        ``TaskCancelled.subject_for(model_id, task_id)``."""
        if len(ids) != len(cls.subject_fields):
            raise ValueError(f"{cls.__name__}'s subject names {', '.join(cls.subject_fields)}")
        if cls.on_chunk_stream:  # a task's chunks share one subject, whatever their type
            return chunk_subject(*ids)
        return event_subject(cls.aggregate, ids, cls.__name__)

    @classmethod
    def filter_for(cls, *ids: str) -> str:
        """The subject filter of this type's events about the members named by ``ids``, the
        leading ones of its ``subject_fields`` (the rest any):
        ``TaskCreated.filter_for(model_id)`` is a model's tasks."""
        if cls.on_chunk_stream or len(ids) > len(cls.subject_fields):
            raise ValueError(f"{cls.__name__} has no filter by {len(ids)} ids")
        return event_type_filter(cls.aggregate, ids, len(cls.subject_fields), cls.__name__)

    @classmethod
    def subject_pattern(cls) -> str:
        """The subject with field names for ids, for documentation."""
        ids = ".".join(f"<{f}>" for f in cls.subject_fields)
        if cls.on_chunk_stream:
            return f"{CHUNKS_PREFIX}.{ids}"
        return f"{EVENTS_PREFIX}.{cls.aggregate}.{ids}.{cls.__name__}"

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


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


class WeightFile(Record):
    """One file of a model's weights, named by its content: held in the cache of the node it was
    added on (and of every node that fetched it), or in the models bucket
    (``bus.streams.MODELS_BUCKET``)."""

    name: str = Field(
        min_length=1,
        description="Its path in the model's directory: 'model.gguf', 'config.json',"
        " 'model-00001-of-00002.safetensors'.",
    )
    object: str = Field(
        min_length=1,
        description="Its object's name in the models bucket (`sha256/<hex>`), whether or not"
        " the bucket holds a copy.",
    )
    size: int = Field(ge=0, description="Bytes.")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file, hex (the object's digest)."
    )


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
    resume: Resume | None = Field(
        default=None, description="A continuation: where the lost runner had got to."
    )


class EmbeddingsRequested(_TaskEvent):
    """A request for embeddings of several inputs, for an embed instance's runners (its own
    type, so that chat runners of the same model, which pull ``TaskCreated``, never take it).
    Answered by ``EmbeddingsComputed`` on the chunk stream, then ``TaskCompleted``."""

    texts: list[str] | None = Field(default=None, description="The inputs as text.")
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


class TaskCancelled(_TaskEvent):
    """The client gave up on the task (e.g. disconnected); runners stop generating."""

    reason: str = ""


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
        " (`resume.attempt`); only the newest attempt's chunks count (bus/attempts.py)."
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
    float32 little-endian (``bus.vectors``), one row of ``dimensions`` after the other: 64
    vectors of 576 dimensions are 197 KB, far below a NATS message's 1 MiB, and larger answers
    come in several slices. Published before the task's ``TaskCompleted``."""

    start: int = Field(description="The index of this slice's first input.")
    total: int = Field(description="Inputs in the whole task.")
    dimensions: int = Field(description="Floats per vector.")
    vectors: str = Field(description="base64 of float32 little-endian, vector after vector.")


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
    | ResponseStored
    | ResponseDeleted
    | KeyAdded
    | KeyRevoked,
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


_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


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
