"""Renders the event catalogue as Markdown (``docs/events.md``), straight from the models."""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from events.catalogue import EVENT_TYPES, WeightFile
from events.records import (
    Accelerator,
    ChatMessage,
    DeviceLayers,
    GpuInfo,
    ImagePart,
    NetworkInterface,
    NodeProfile,
    PartRef,
    ResponseFormat,
    SamplingParams,
    ShardAssignment,
    Timings,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    TopLogprob,
    Usage,
)

RECORDS: tuple[type[BaseModel], ...] = (
    NodeProfile,
    Accelerator,
    GpuInfo,
    NetworkInterface,
    ShardAssignment,
    DeviceLayers,
    WeightFile,
    ChatMessage,
    ImagePart,
    PartRef,
    ToolCall,
    Tool,
    ToolChoice,
    ResponseFormat,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    ToolCallDelta,
    Usage,
    Timings,
)
_BASE_FIELDS = ("event_id", "ts", "origin", "v")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`" if field.default_factory() != "" else "generated"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{field.default!r}`"


def _fields_table(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        meaning = (field.description or "").replace("|", "\\|")
        lines.append(
            f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {meaning} |"
        )
    return lines


def _doc(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    inherited = {inspect.getdoc(b) for b in model.__mro__[1:]}
    return "" if doc in inherited else re.sub(r"\s+", " ", doc)


def render() -> str:
    out = [
        "# Events",
        "",
        "Generated from `events/` (`catalogue.py`) by `shoal events doc > docs/events.md`; a test",
        "fails when this file is stale. Every event is JSON with a `type` field naming it, and",
        "these fields:",
        "",
        "| field | meaning |",
        "|---|---|",
        "| `type` | the event type, below |",
        "| `event_id` | unique id, sent as `Nats-Msg-Id` unless a deterministic one is used |",
        "| `ts` | when the fact happened, ISO 8601 UTC |",
        "| `origin` | node id or service that published it |",
        "| `v` | schema version of the event type |",
        "",
        "Ids inside subjects are escaped: any character but letters, digits, `-`, `_`, `:` and",
        "`=` becomes `%XX` (so `Qwen2.5` is `Qwen2%2E5`).",
        "",
    ]
    for cls in EVENT_TYPES:
        type_name = cls.model_fields["type"].default
        stream = CHUNKS_STREAM if cls.on_chunk_stream else EVENTS_STREAM
        out += [f"## {type_name}", ""]
        if doc := _doc(cls):
            out += [doc, ""]
        out += [f"Subject `{cls.subject_pattern()}` on stream `{stream}`.", ""]
        out += _fields_table(cls, skip=(*_BASE_FIELDS, "type"))
        out.append("")
    out += ["# Nested records", ""]
    for rec in RECORDS:
        out += [f"## {rec.__name__}", ""]
        if doc := _doc(rec):
            out += [doc, ""]
        out += _fields_table(rec)
        out.append("")
    return "\n".join(out)
