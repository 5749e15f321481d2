"""The event catalogue: every fact Shoal records, as frozen pydantic models.

One model per event type, discriminated by ``type``. Events are JSON on the wire so that
``nats sub 'shoal.events.>'`` shows readable text. An event is never edited: a new field gets a
default, a changed meaning gets a new type or a new ``v``. Unknown extra fields are ignored, so
an older consumer still reads a newer producer's events.

What every event is (its type, id, time, subjects) is ``event_base.py``; the events themselves
are ``cluster_events.py`` (nodes, models, instances, runners, API keys), ``task_events.py``
(tasks, responses) and ``chunk_events.py`` (the chunk stream: tokens, prompt scores,
embeddings, image steps and images). This module holds the log's own event, the union of
all, ``Event``, and how events are parsed; it names every event again, so that importers take
them all from here.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, get_args

from pydantic import ConfigDict, Field, TypeAdapter

from events.chunk_events import ChunkGenerated as ChunkGenerated
from events.chunk_events import EmbeddingsComputed as EmbeddingsComputed
from events.chunk_events import ImageGenerated as ImageGenerated
from events.chunk_events import ImageStepped as ImageStepped
from events.chunk_events import PromptScored as PromptScored
from events.cluster_events import InstanceDeleted as InstanceDeleted
from events.cluster_events import InstanceDeleteRequested as InstanceDeleteRequested
from events.cluster_events import InstancePlaced as InstancePlaced
from events.cluster_events import InstanceRequested as InstanceRequested
from events.cluster_events import KeyAdded as KeyAdded
from events.cluster_events import KeyRevoked as KeyRevoked
from events.cluster_events import ModelAdded as ModelAdded
from events.cluster_events import ModelEvicted as ModelEvicted
from events.cluster_events import ModelRemoved as ModelRemoved
from events.cluster_events import NodeJoined as NodeJoined
from events.cluster_events import NodeLeft as NodeLeft
from events.cluster_events import NodeTimedOut as NodeTimedOut
from events.cluster_events import PlacementRejected as PlacementRejected
from events.cluster_events import ResourceProfiled as ResourceProfiled
from events.cluster_events import RunnerStateChanged as RunnerStateChanged
from events.event_base import SCHEMA_VERSION as SCHEMA_VERSION
from events.event_base import EventBase as EventBase
from events.event_base import new_id as new_id
from events.event_base import utc_now as utc_now
from events.records import Id
from events.records import WeightFile as WeightFile
from events.subjects import Aggregate
from events.task_events import EmbeddingsRequested as EmbeddingsRequested
from events.task_events import ResponseDeleted as ResponseDeleted
from events.task_events import ResponseStored as ResponseStored
from events.task_events import Resume as Resume
from events.task_events import TaskCancelled as TaskCancelled
from events.task_events import TaskCompleted as TaskCompleted
from events.task_events import TaskCreated as TaskCreated
from events.task_events import TaskFailed as TaskFailed
from events.task_events import TaskForgotten as TaskForgotten
from events.task_events import TaskStarted as TaskStarted

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
    | ImageStepped
    | ImageGenerated
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
    (t.__name__, f'"type":"{t.__name__}"'.encode())
    for t in (PromptScored, EmbeddingsComputed, ImageStepped, ImageGenerated)
)
