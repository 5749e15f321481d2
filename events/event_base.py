"""What every event is (``EventBase``): its type, id, time, origin and schema version, and the
subjects it is published on and filtered by. The catalogue of events is ``events/catalogue.py``."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, cast

from pydantic import Field

from events.records import Record
from events.subjects import (
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
