"""Fuzzing the event consumer: whatever lands on ``shoal.events.>``, a consumer keeps going.

Hypothesis draws a sequence of messages and publishes them raw (``js.publish``, no
``Nats-Msg-Id``) onto ``shoal.events.<...>`` subjects of a real nats-server, valid events
interleaved with bad messages:

- bytes that are not JSON: random bytes, events cut short, invalid UTF-8, empty and blank
  payloads;
- JSON that is not an object, objects without ``type``, objects with an unknown ``type``;
- events of a known type with a field of the wrong type (an object where a string, number,
  list or time goes: extra nesting; a number where an object or list goes), at any depth, with a
  required field missing, an empty id, or a number JSON has no word for (NaN, Infinity);
- payloads of up to the server's ``max_payload`` (1 MiB), bad and valid; one byte more is
  refused at publish (nats-py's MaxPayloadError), stores nothing and leaves the connection up.

Valid events come as the publishers write them, or with unknown extra fields (nested values
too), which consumers ignore; some hold values the projection cannot store (a time without a
zone, numbers beyond 32 or 64 bits, over-long strings), which are valid events for a consumer
and are left to the projector's fuzz test (tests/projectors/test_projector_fuzz.py).

A real EventConsumer (bus/consumer.py) reads everything, by ``fetch`` in batches of a drawn size
or by ``run`` with a handler, and the test checks: every valid event is delivered once, in
order, equal to what was published; every bad message is in SHOAL_DEADLETTER exactly once, with
its payload (the first bytes of it, and its size in a header, when it does not fit with the
headers), the subject and sequence it came from and a reason saying what is wrong; the counts
agree: the consumer's own, its one log line per dead letter, and the per-stream count that
``GET /metrics`` reports as ``shoal_dead_letters`` (api/metrics.py reads it from the dead-letter
stream the same way); nothing is left pending or unacknowledged.

One nats-server per test function; before each example both streams are purged and the example
gets a durable consumer of its own, so examples do not see each other's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import nats.errors
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, RawStreamMsg

from api.cluster_metrics import dead_letters_by_stream
from bus.consumer import (
    CONSUMER_HEADER,
    REASON_HEADER,
    SEQ_HEADER,
    SIZE_HEADER,
    STREAM_HEADER,
    SUBJECT_HEADER,
    Delivered,
    EventConsumer,
)
from bus.payload import PayloadTooLargeError, message_size
from bus.publisher import ChunkPublisher, Publisher
from bus.streams import DEADLETTER_STREAM, EVENTS_STREAM, ensure_streams
from events.catalogue import (
    EVENT_TYPES,
    ChunkGenerated,
    Event,
    EventBase,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    NodeLeft,
    NodeTimedOut,
    PlacementRejected,
    ResourceProfiled,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
)
from events.kinds import ENGINES
from events.records import (
    ChatMessage,
    GpuInfo,
    NetworkInterface,
    NodeProfile,
    SamplingParams,
    ShardAssignment,
    Timings,
    Usage,
)
from events.subjects import DEADLETTER_PREFIX, EVENTS_PREFIX, event_subject

MAX_EXAMPLES = 40
MAX_PAYLOAD = 1024 * 1024  # nats-server's default max_payload (checked against the server)
ALL_EVENTS = f"{EVENTS_PREFIX}.>"
KNOWN_TYPES = frozenset(str(t.model_fields["type"].default) for t in EVENT_TYPES)

FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    database=None,
    # One server per test function, shared by its examples (each purges the streams first).
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


# --- valid events ---------------------------------------------------------------------------

# Few ids, so that events meet: a node leaves after joining, a task completes after starting.
IDS = st.sampled_from(["a", "b", "node-1", "Qwen2.5-0.5B", "ü x"])
# Text the projection can store anywhere (no NUL: PostgreSQL refuses it in text).
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
ZONES = st.sampled_from(
    [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(-timedelta(hours=8))]
)
TIMES = st.datetimes(datetime(2000, 1, 1), datetime(2100, 1, 1), timezones=ZONES)
BYTES = st.integers(0, 2**62)
SMALL = st.integers(0, 10_000)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
EVENT_IDS = st.uuids().map(lambda u: u.hex)


def _event(cls: type[EventBase], **fields: Any) -> st.SearchStrategy[EventBase]:
    return st.builds(cls, event_id=EVENT_IDS, ts=TIMES, origin=TEXT, **fields)


PROFILES = st.builds(
    NodeProfile,
    ram_total=BYTES,
    ram_available=BYTES,
    swap_total=BYTES,
    swap_used=BYTES,
    cpu_count=SMALL,
    cpu_model=TEXT,
    cpu_load=FLOATS,
    disk_free=BYTES,
    memory_offered=BYTES,
    interfaces=st.lists(
        st.builds(
            NetworkInterface,
            name=TEXT,
            addresses=st.lists(TEXT, max_size=2),
            is_up=st.booleans(),
            speed_mbps=st.none() | SMALL,
        ),
        max_size=2,
    ),
    gpus=st.lists(
        st.builds(
            GpuInfo,
            index=st.integers(0, 3),
            name=TEXT,
            memory_total=BYTES,
            memory_used=BYTES,
            utilisation=st.none() | FLOATS,
        ),
        max_size=2,
    ),
)
SHARDS = st.builds(
    ShardAssignment,
    runner_id=IDS,
    node_id=IDS,
    device=st.sampled_from(["cpu", "gpu0"]),
    replica=SMALL,
    rank=SMALL,
    world_size=SMALL,
    start_layer=SMALL,
    end_layer=SMALL,
    n_layers=SMALL,
    tensor_split=st.none() | st.lists(FLOATS, max_size=3),
)
TASK = {"task_id": IDS, "model_id": IDS}

# The events whose rule always writes their values (whatever came before).
ALWAYS_WRITTEN: st.SearchStrategy[EventBase] = st.one_of(
    _event(
        NodeJoined,
        node_id=IDS,
        hostname=TEXT,
        addresses=st.lists(TEXT, max_size=2),
        version=TEXT,
        heartbeat_s=st.none() | FLOATS,
    ),
    _event(ResourceProfiled, node_id=IDS, profile=PROFILES),
    _event(
        ModelAdded,
        model_id=IDS,
        n_layers=SMALL,
        size_bytes=BYTES,
        family=TEXT,
        context_length=SMALL,
        engines=st.lists(st.sampled_from(ENGINES), max_size=2),
        chat_format=st.none() | TEXT,
        source=TEXT,
        path=st.none() | TEXT,
        kv_bytes_per_token=BYTES,
        overhead_bytes=BYTES,
    ),
)
VALID_EVENTS: st.SearchStrategy[EventBase] = st.one_of(
    ALWAYS_WRITTEN,
    _event(NodeLeft, node_id=IDS, reason=TEXT),
    _event(NodeTimedOut, node_id=IDS, last_seen=TIMES, missed_heartbeats=SMALL),
    _event(
        InstanceRequested,
        instance_id=IDS,
        model_id=IDS,
        placement=st.none() | TEXT,
        replicas=st.integers(1, 4),
        context_length=st.none() | SMALL,
    ),
    _event(
        InstancePlaced,
        instance_id=IDS,
        model_id=IDS,
        shards=st.lists(SHARDS, max_size=3),
        generation=st.none() | st.integers(0, 4),
        reason=TEXT,
        avoid=st.lists(TEXT, max_size=2),
    ),
    _event(
        PlacementRejected,
        instance_id=IDS,
        model_id=IDS,
        reason=TEXT,
        needed_bytes=st.none() | BYTES,
        available_bytes=st.dictionaries(TEXT, BYTES, max_size=2),
        generation=st.none() | st.integers(0, 4),
        avoid=st.lists(TEXT, max_size=2),
    ),
    _event(InstanceDeleteRequested, instance_id=IDS, reason=TEXT),
    _event(InstanceDeleted, instance_id=IDS, reason=TEXT),
    _event(
        RunnerStateChanged,
        runner_id=IDS,
        instance_id=IDS,
        node_id=IDS,
        state=st.sampled_from(["Assigned", "Loading", "Ready", "Running", "Failed", "Stopped"]),
        progress=st.none() | FLOATS,
        error=st.none() | TEXT,
        exit_code=st.none() | SMALL,
        endpoint=st.none() | TEXT,
        pid=st.none() | SMALL,
    ),
    _event(
        TaskCreated,
        **TASK,
        kind=st.sampled_from(["chat", "completion"]),
        messages=st.none()
        | st.lists(st.builds(ChatMessage, role=st.just("user"), content=TEXT), max_size=2),
        prompt=st.none() | TEXT,
        params=st.builds(SamplingParams, max_tokens=st.none() | SMALL),
        user=st.none() | TEXT,
    ),
    _event(TaskStarted, **TASK, runner_id=IDS, instance_id=IDS),
    _event(
        TaskCompleted,
        **TASK,
        runner_id=IDS,
        finish_reason=st.sampled_from(["stop", "length"]),
        usage=st.builds(Usage, prompt_tokens=SMALL, completion_tokens=SMALL),
        timings=st.builds(Timings, ttft_ms=FLOATS, tokens_per_s=FLOATS, total_ms=FLOATS),
    ),
    _event(TaskFailed, **TASK, runner_id=st.none() | IDS, error=TEXT),
    _event(TaskCancelled, **TASK, reason=TEXT),
    _event(ChunkGenerated, task_id=IDS, idx=SMALL, text=TEXT),  # parses; its rule changes nothing
)


# --- messages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One message to publish and what must become of it."""

    subject: str
    data: bytes
    event: EventBase | None = None  # the event a consumer delivers; None: a bad message
    reasons: tuple[str, ...] = ()  # a bad message: how its dead-letter reason may start
    mentions: tuple[str, ...] = ()  # ... and words it must contain (field names)
    unstorable: str = ""  # a valid event the projection cannot hold: "table.column"
    refused: bool = False  # larger than the server accepts: refused at publish

    @property
    def bad(self) -> bool:
        return self.event is None and not self.refused

    def __repr__(self) -> str:  # hypothesis shows failing examples; keep 1 MiB out of them
        data = self.data if len(self.data) <= 200 else self.data[:200] + b"..."
        what = "refused" if self.refused else "bad" if self.bad else "valid"
        return f"Message({what}, {self.subject!r}, {len(self.data)} bytes: {data!r})"


JSON_SCALARS = st.none() | st.booleans() | st.integers() | FLOATS | TEXT
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
TOKENS = st.from_regex(r"\A[A-Za-z0-9_%=:-]{1,10}\Z")
BAD_SUBJECTS = st.lists(TOKENS, min_size=1, max_size=4).map(
    lambda tokens: f"{EVENTS_PREFIX}.{'.'.join(tokens)}"
)


def _subject(event: EventBase) -> str:
    if isinstance(event, ChunkGenerated):  # its subject is on the chunk stream: use an event one
        return event_subject(event.aggregate, (event.task_id,), event.type)
    return event.subject


def _valid(event: EventBase, data: bytes | None = None, unstorable: str = "") -> Message:
    data = event.to_json() if data is None else data
    return Message(_subject(event), data, event, unstorable=unstorable)


def _as_dict(event: EventBase) -> dict[str, Any]:
    out: dict[str, Any] = event.model_dump(mode="json")
    return out


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def with_extra_fields(draw: st.DrawFn) -> Message:
    """A valid event with unknown fields added (a newer producer's): still valid."""
    event = draw(VALID_EVENTS)
    extra = draw(st.dictionaries(TEXT.map(lambda k: f"x_{k}"), JSON_VALUES, min_size=1, max_size=3))
    return _valid(event, _dumps(_as_dict(event) | extra))


def _bad(subject: str, data: bytes, *reasons: str, mentions: Sequence[str] = ()) -> Message:
    return Message(subject, data, reasons=reasons, mentions=tuple(mentions))


@st.composite
def not_json(draw: st.DrawFn) -> Message:
    subject = draw(BAD_SUBJECTS)
    kind = draw(st.sampled_from(["random", "cut", "utf8", "blank"]))
    if kind == "random":  # random bytes after one that can never start UTF-8
        data = b"\xff" + draw(st.binary(max_size=64))
    elif kind == "cut":  # an event cut short: never a complete object
        whole = draw(VALID_EVENTS).to_json()
        data = whole[: draw(st.integers(0, len(whole) - 1))]
    elif kind == "utf8":  # an invalid byte somewhere in an event
        whole = draw(VALID_EVENTS).to_json()
        at = draw(st.integers(0, len(whole)))
        data = whole[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + whole[at:]
    else:
        data = draw(st.sampled_from([b"", b" ", b"\n", b"\t\r\n "]))
    return _bad(subject, data, "invalid JSON")


@st.composite
def not_an_object(draw: st.DrawFn) -> Message:
    value = draw(JSON_SCALARS | st.lists(JSON_VALUES, max_size=3))
    return _bad(draw(BAD_SUBJECTS), _dumps(value), "invalid event", mentions=["object"])


@st.composite
def without_type(draw: st.DrawFn) -> Message:
    if draw(st.booleans()):
        obj = _as_dict(draw(VALID_EVENTS))
        del obj["type"]
    else:
        obj = draw(st.dictionaries(TEXT.filter(lambda k: k != "type"), JSON_VALUES, max_size=4))
    return _bad(draw(BAD_SUBJECTS), _dumps(obj), "no 'type' field")


@st.composite
def unknown_type(draw: st.DrawFn) -> Message:
    obj = _as_dict(draw(VALID_EVENTS))
    obj["type"] = draw(
        TEXT.filter(lambda t: t not in KNOWN_TYPES)
        | st.none()
        | st.booleans()
        | st.integers()
        | FLOATS  # not a string
        | st.lists(JSON_VALUES, max_size=3)
        | st.dictionaries(TEXT, JSON_VALUES, max_size=3)
    )
    return _bad(draw(BAD_SUBJECTS), _dumps(obj), "unknown event type")


def _paths(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every place inside an event's JSON, but its ``type``."""
    items: Any = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, inner in items:
        if path or key != "type":
            yield (*path, key)
            yield from _paths(inner, (*path, key))


def _replace(value: Any, path: tuple[str | int, ...], new: Any) -> None:
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


def _field_name(path: tuple[str | int, ...]) -> str:
    return next(str(p) for p in reversed(path) if isinstance(p, str))


def _value_at(value: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


@st.composite
def wrong_field_type(draw: st.DrawFn) -> Message:
    """A value of the wrong kind at any depth: an object where a scalar or list goes (extra
    nesting), a number where an object goes, an object where a list goes."""
    event = draw(VALID_EVENTS)
    obj = _as_dict(event)
    path = draw(st.sampled_from(list(_paths(obj))))
    old = _value_at(obj, path)
    new: Any
    if isinstance(old, dict):
        new = draw(st.integers() | st.lists(JSON_SCALARS, max_size=2))
    else:
        new = {"nested": draw(JSON_VALUES)}
    _replace(obj, path, new)
    return _bad(_subject(event), _dumps(obj), "invalid event", mentions=[_field_name(path)])


@st.composite
def missing_field(draw: st.DrawFn) -> Message:
    event = draw(VALID_EVENTS)
    obj = _as_dict(event)
    required = [n for n, f in type(event).model_fields.items() if f.is_required()]
    name = draw(st.sampled_from(required))
    del obj[name]
    return _bad(_subject(event), _dumps(obj), "invalid event", mentions=[name, "required"])


@st.composite
def bad_value(draw: st.DrawFn) -> Message:
    """The right kind, a value no event may hold: an empty id, NaN or Infinity."""
    event = draw(VALID_EVENTS)
    obj = _as_dict(event)
    floats = [p for p in _paths(obj) if isinstance(_value_at(obj, p), float)]
    use_a_float = draw(st.booleans())
    if floats and use_a_float:
        path = draw(st.sampled_from(floats))
        _replace(obj, path, draw(st.sampled_from([math.nan, math.inf, -math.inf])))
        return _bad(
            _subject(event), _dumps(obj), "invalid event", mentions=[_field_name(path), "finite"]
        )
    name = draw(st.sampled_from(type(event).subject_fields))
    obj[name] = ""
    return _bad(_subject(event), _dumps(obj), "invalid event", mentions=[name])


def _pad_to(size: int) -> bytes:
    """A bad payload of exactly ``size`` bytes that starts like an event."""
    head = b'{"type": "NodeJoined", "origin": "fuzz", "hostname": "'
    return (head + b"x" * size)[:size]


@st.composite
def near_the_limit(draw: st.DrawFn) -> Message:
    """Up to max_payload: bad (dead-lettered, in part when it does not fit with the headers),
    valid (delivered), or one byte over (refused at publish)."""
    kind = draw(st.sampled_from(["bad", "valid", "over"]))
    size = MAX_PAYLOAD - draw(st.sampled_from([0, 1, 150, 5000]))
    if kind == "over":
        return Message(draw(BAD_SUBJECTS), b"x" * (MAX_PAYLOAD + 1), refused=True)
    if kind == "bad":
        return _bad(draw(BAD_SUBJECTS), _pad_to(size), "invalid JSON")
    base = TaskCreated(task_id="big", model_id="m", origin="fuzz", prompt="", event_id="big")
    pad = size - len(base.to_json())
    return _valid(base.model_copy(update={"prompt": "p" * pad}))


@st.composite
def unstorable(draw: st.DrawFn) -> Message:
    """Valid events with a value the projection cannot hold on SQLite and PostgreSQL alike;
    each always writes that value, whatever came before."""
    event = draw(ALWAYS_WRITTEN)
    column, update = draw(st.sampled_from(_UNSTORABLE[type(event)]))
    if isinstance(event, ResourceProfiled):
        update = {"profile": event.profile.model_copy(update=update)}
    changed = event.model_copy(update=update)
    return _valid(changed, unstorable=column)


_UNSTORABLE: dict[type[EventBase], list[tuple[str, dict[str, Any]]]] = {
    NodeJoined: [
        ("nodes.hostname", {"hostname": "h" * 256}),
        ("nodes.hostname", {"hostname": "nul\x00"}),
        ("nodes.version", {"version": "v" * 51}),
        ("nodes.joined_at", {"ts": datetime(2026, 1, 1, 12, 0)}),  # no time zone
        ("nodes.joined_at", {"ts": datetime(1, 1, 1, 0, 30, tzinfo=timezone(timedelta(hours=1)))}),
    ],
    ModelAdded: [
        ("models.n_layers", {"n_layers": 2**31}),
        ("models.size_bytes", {"size_bytes": 2**63}),
        ("models.family", {"family": "f" * 101}),
    ],
    ResourceProfiled: [
        ("nodes.ram_total", {"ram_total": 2**64 + 1}),
        ("nodes.cpu_count", {"cpu_count": -(2**31) - 1}),
        ("nodes.cpu_model", {"cpu_model": "c" * 300}),
    ],
}

VALID = st.one_of(VALID_EVENTS.map(_valid), with_extra_fields())
# Every kind of message in every example (drawn one by one, most would be valid events).
KINDS = (
    not_json(),
    not_an_object(),
    without_type(),
    unknown_type(),
    wrong_field_type(),
    missing_field(),
    bad_value(),
    unstorable(),
    near_the_limit(),
)


@st.composite
def message_lists(draw: st.DrawFn) -> list[Message]:
    """Up to 10 valid events and one or two messages of every kind, in a random order."""
    messages = draw(st.lists(VALID, min_size=1, max_size=10))
    for kind in KINDS:
        messages += draw(st.lists(kind, min_size=1, max_size=2))
    return list(draw(st.permutations(messages)))


MESSAGES = message_lists()


# --- publishing and reading back ------------------------------------------------------------


@dataclass
class Published:
    messages: list[Message]
    seqs: list[int]  # stream sequence of each stored message, 0 for a refused one
    last_seq: int

    def valid(self) -> list[tuple[Message, int]]:
        return [
            (m, s) for m, s in zip(self.messages, self.seqs, strict=True) if m.event is not None
        ]

    def bad(self) -> list[tuple[Message, int]]:
        return [(m, s) for m, s in zip(self.messages, self.seqs, strict=True) if m.bad]


async def publish(nc: Client, js: JetStreamContext, messages: list[Message]) -> Published:
    """Make the streams anew (their sequences start at 1 again: a log whose first events are
    gone is one a projector refuses without a snapshot), then publish ``messages`` raw, in
    order. A message larger than the server accepts must be refused by the client, and leave
    the connection usable."""
    note("messages:\n" + "\n".join(f"  {m!r}" for m in messages))  # shown if the example fails
    assert nc.max_payload == MAX_PAYLOAD
    await js.delete_stream(EVENTS_STREAM)
    await js.delete_stream(DEADLETTER_STREAM)
    await ensure_streams(js)
    seqs = []
    for m in messages:
        if m.refused:
            with pytest.raises(nats.errors.MaxPayloadError):
                await js.publish(m.subject, m.data)
            seqs.append(0)
        else:
            seqs.append((await js.publish(m.subject, m.data)).seq)
    assert nc.is_connected
    stored = (await js.stream_info(EVENTS_STREAM)).state.messages
    assert stored == len([s for s in seqs if s])  # a refused message stored nothing
    return Published(messages, seqs, max(seqs))


async def dead_letters(js: JetStreamContext) -> list[RawStreamMsg]:
    state = (await js.stream_info(DEADLETTER_STREAM)).state
    if state.messages == 0:
        return []
    return [
        await js.get_msg(DEADLETTER_STREAM, s) for s in range(state.first_seq, state.last_seq + 1)
    ]


async def metrics_dead_letters(js: JetStreamContext) -> int:
    """What ``GET /metrics`` reports as ``shoal_dead_letters{stream="SHOAL_EVENTS"}``."""
    info = await js.stream_info(DEADLETTER_STREAM, subjects_filter=f"{DEADLETTER_PREFIX}.>")
    return dead_letters_by_stream(info.state.subjects or {}).get(EVENTS_STREAM, 0)


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged_dead_letters() -> Iterator[list[str]]:
    """The consumer's warning lines, one per dead letter."""
    handler = LogLines()
    logger = logging.getLogger("bus.consumer")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def as_header(text: str) -> str:
    """``text`` as a dead letter's header holds it: ASCII, with line breaks as spaces."""
    return text.encode("ascii", "backslashreplace").decode().replace("\r", " ").replace("\n", " ")


def check_dead_letters(
    dead: list[RawStreamMsg],
    expected: list[tuple[Message, int, str, tuple[str, ...]]],
    durable: str,
) -> None:
    """Exactly one dead letter per (message, seq, reason start, words in the reason)."""
    by_seq: dict[int, list[RawStreamMsg]] = {}
    for d in dead:
        assert d.headers is not None
        by_seq.setdefault(int(d.headers[SEQ_HEADER]), []).append(d)
    assert sorted(by_seq) == sorted(seq for _, seq, _, _ in expected), "dead letters vs bad"
    for m, seq, start, mentions in expected:
        (d,) = by_seq[seq]  # exactly once
        assert d.headers is not None
        reason = d.headers[REASON_HEADER]
        assert reason.startswith(start), (reason, m)
        for word in mentions:
            assert as_header(word) in reason, (word, reason, m)
        assert d.subject == f"{DEADLETTER_PREFIX}.{EVENTS_STREAM}"
        assert d.headers[SUBJECT_HEADER] == m.subject
        assert d.headers[STREAM_HEADER] == EVENTS_STREAM
        assert d.headers[CONSUMER_HEADER] == durable
        if SIZE_HEADER in d.headers:  # kept in part: it did not fit with the headers
            assert int(d.headers[SIZE_HEADER]) == len(m.data)
            assert d.data is not None and m.data.startswith(d.data)
            assert message_size(m.data, d.headers) > MAX_PAYLOAD >= message_size(d.data, d.headers)
        else:
            assert (d.data or b"") == m.data  # nats-py reads an empty payload back as None


def bad_expectations(published: Published) -> list[tuple[Message, int, str, tuple[str, ...]]]:
    """For a bare consumer: every bad message, and which reasons its dead letter may give."""
    out = []
    for m, seq in published.bad():
        (start,) = m.reasons
        out.append((m, seq, start, m.mentions))
    return out


async def settled(js: JetStreamContext, durable: str) -> ConsumerInfo:
    """Consumer info once no acks are outstanding (acks are sent without waiting)."""
    deadline = time.monotonic() + 5.0
    while True:
        info: ConsumerInfo = await js.consumer_info(EVENTS_STREAM, durable)
        if info.num_ack_pending == 0 or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.02)


_durables = itertools.count()


async def check_consumer(
    js: JetStreamContext,
    c: EventConsumer,
    published: Published,
    events: list[Event],
    lines: list[str],
) -> None:
    """What a consumer that has read everything ``published`` must have done."""
    valid = published.valid()
    bad = published.bad()
    assert events == [m.event for m, _ in valid]
    check_dead_letters(await dead_letters(js), bad_expectations(published), c.durable)
    assert c.stats.delivered == len(valid)
    assert c.stats.dead_letters == len(bad)
    assert sum(c.stats.dead_letter_reasons.values()) == len(bad)
    assert len([line for line in lines if line.startswith("dead-lettered")]) == len(bad)
    assert await metrics_dead_letters(js) == len(bad)
    info = await settled(js, c.durable)
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)


async def drain(c: EventConsumer, last_seq: int, batch: int, got: list[Delivered]) -> None:
    async with asyncio.timeout(30):
        while c.last_stream_seq < last_seq:
            for d in await c.fetch(batch, timeout=0.5):
                got.append(d)
                await d.ack()


# --- the tests ------------------------------------------------------------------------------


@FUZZ_SETTINGS
@given(messages=MESSAGES, batch=st.integers(1, 20))
async def test_fetch_delivers_every_valid_event_and_dead_letters_every_bad_one(
    nc: Client, js: JetStreamContext, messages: list[Message], batch: int
) -> None:
    published = await publish(nc, js, messages)
    c = EventConsumer(js, EVENTS_STREAM, f"fuzz-fetch-{next(_durables)}", ALL_EVENTS)
    await c.start()
    got: list[Delivered] = []
    try:
        with logged_dead_letters() as lines:
            await drain(c, published.last_seq, batch, got)
        assert await c.fetch(10, timeout=0.1) == []
        assert [d.stream_seq for d in got] == [seq for _, seq in published.valid()]
        await check_consumer(js, c, published, [d.event for d in got], lines)
    finally:
        await c.stop()
        await js.delete_consumer(EVENTS_STREAM, c.durable)


@FUZZ_SETTINGS
@given(messages=MESSAGES)
async def test_run_handles_every_valid_event_and_dead_letters_every_bad_one(
    nc: Client, js: JetStreamContext, messages: list[Message]
) -> None:
    published = await publish(nc, js, messages)
    c = EventConsumer(js, EVENTS_STREAM, f"fuzz-run-{next(_durables)}", ALL_EVENTS)
    await c.start()
    handled: list[Event] = []

    async def handle(event: Event) -> None:
        handled.append(event)

    got: list[Delivered] = []
    try:
        with logged_dead_letters() as lines:
            n_valid = len(published.valid())
            await asyncio.wait_for(c.run(handle, stop_after=n_valid), 30)
            await drain(c, published.last_seq, 10, got)  # bad messages after the last valid one
        assert got == []
        await check_consumer(js, c, published, handled, lines)
    finally:
        await c.stop()
        await js.delete_consumer(EVENTS_STREAM, c.durable)


async def test_a_message_over_max_payload_is_refused_at_publish(
    nc: Client, js: JetStreamContext
) -> None:
    """One byte over the server's limit: nats-py refuses it before sending (MaxPayloadError,
    "nats: maximum payload exceeded"); nothing is stored, the connection stays up."""
    assert nc.max_payload == MAX_PAYLOAD
    with pytest.raises(nats.errors.MaxPayloadError, match="maximum payload exceeded"):
        await js.publish(f"{EVENTS_PREFIX}.node.x.NodeJoined", b"x" * (MAX_PAYLOAD + 1))
    assert nc.is_connected
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 0
    ack = await js.publish(f"{EVENTS_PREFIX}.node.x.NodeJoined", b"x" * MAX_PAYLOAD)  # the limit
    assert ack.seq == 1


async def test_an_event_too_large_with_its_headers_is_refused_at_publish(
    nc: Client, js: JetStreamContext
) -> None:
    """An event within max_payload, but not with its ``Nats-Msg-Id`` header: nats-py would
    send it and the server close the connection over it, for good. Publisher and
    ChunkPublisher refuse it first, with a clear error; the connection stays up."""
    base = TaskCreated(task_id="big", model_id="m", origin="fuzz", prompt="")
    event = base.model_copy(update={"prompt": "p" * (MAX_PAYLOAD - len(base.to_json()) - 10)})
    assert len(event.to_json()) <= MAX_PAYLOAD < message_size(event.to_json(), {"Nats-Msg-Id": "x"})
    chunk = ChunkGenerated(task_id="big", idx=0, text="t" * (MAX_PAYLOAD - 150), origin="fuzz")
    for publish_it in (Publisher(js).publish(event), ChunkPublisher(js).publish(chunk)):
        with pytest.raises(PayloadTooLargeError, match="more than the server's max_payload") as e:
            await publish_it
        assert isinstance(e.value, nats.errors.MaxPayloadError)
    assert nc.is_connected
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 0
    ack = await Publisher(js).publish(NodeJoined(node_id="after", origin="fuzz"))
    assert ack.seq == 1
