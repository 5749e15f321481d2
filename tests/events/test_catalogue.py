"""The event catalogue: every type has a subject and round-trips through JSON."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
import typing
import uuid
from datetime import UTC, datetime, timedelta

import pydantic
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from events.catalogue import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    ChunkGenerated,
    EmbeddingsComputed,
    EmbeddingsRequested,
    Event,
    EventBase,
    ImageGenerated,
    ImageStepped,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    KeyAdded,
    KeyRevoked,
    LogTailLost,
    ModelAdded,
    ModelEvicted,
    ModelRemoved,
    NodeJoined,
    NodeLeft,
    NodeTimedOut,
    PlacementRejected,
    PromptScored,
    ResourceProfiled,
    ResponseDeleted,
    ResponseStored,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
    TaskStarted,
    chunk_stream_type,
    parse_event,
    subject_event_type,
)
from events.records import (
    ChatMessage,
    GpuInfo,
    ImageParams,
    ImagePart,
    NetworkInterface,
    NodeProfile,
    PartRef,
    SamplingParams,
    ShardAssignment,
    Timings,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolChoice,
    TopLogprob,
    Usage,
)
from events.subjects import unescape_token
from events.units import GiB

TS = datetime(2026, 11, 1, 12, 0, 0, 123456, tzinfo=UTC)
MODEL = "Qwen2.5-0.5B"


def _profile() -> NodeProfile:
    return NodeProfile(
        ram_total=32 * GiB,
        ram_available=20 * GiB,
        swap_total=2 * GiB,
        swap_used=10 * 1024**2,
        cpu_count=12,
        cpu_model="AMD Ryzen 9 7900",
        cpu_load=12.5,
        disk_free=500 * GiB,
        memory_offered=16 * GiB,
        interfaces=[
            NetworkInterface(name="eth0", addresses=["192.168.1.20", "fe80::1"], speed_mbps=1000),
            NetworkInterface(name="lo", addresses=["127.0.0.1"]),
        ],
        gpus=[
            GpuInfo(
                index=0,
                name="NVIDIA RTX 4090",
                memory_total=24 * GiB,
                memory_used=GiB,
                utilisation=3.0,
            )
        ],
    )


def _shards() -> list[ShardAssignment]:
    return [
        ShardAssignment(
            runner_id="inst-1-r0-0",
            node_id="node-a",
            device="gpu0",
            rank=0,
            world_size=2,
            start_layer=0,
            end_layer=16,
            n_layers=24,
            tensor_split=[0.66, 0.34],
        ),
        ShardAssignment(
            runner_id="inst-1-r0-1",
            node_id="node-b",
            rank=1,
            world_size=2,
            start_layer=16,
            end_layer=24,
            n_layers=24,
        ),
    ]


# One realistic instance of every event type. A type added to EVENT_TYPES without a sample here
# makes test_every_event_type_has_a_sample (and the parametrised tests) fail.
SAMPLES: dict[type[EventBase], EventBase] = {
    NodeJoined: NodeJoined(
        node_id="node-a",
        origin="node-a",
        ts=TS,
        hostname="box-a.local",
        addresses=["192.168.1.20:50052"],
        version="0.1.0",
    ),
    NodeLeft: NodeLeft(node_id="node-a", origin="node-a", ts=TS, reason="shutdown"),
    NodeTimedOut: NodeTimedOut(
        node_id="node-c",
        origin="planner",
        ts=TS,
        last_seen=TS - timedelta(seconds=15),
        missed_heartbeats=3,
    ),
    ResourceProfiled: ResourceProfiled(
        node_id="node-a", origin="node-a", ts=TS, profile=_profile()
    ),
    ModelAdded: ModelAdded(
        model_id=MODEL,
        origin="cli",
        ts=TS,
        family="qwen2",
        n_layers=24,
        context_length=32768,
        size_bytes=398 * 1024**2,
        engines=["llamacpp", "mlx"],
        chat_format="chatml",
        source="hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF",
        path="/models/qwen2.5-0.5b-instruct-q4_k_m.gguf",
    ),
    ModelRemoved: ModelRemoved(model_id=MODEL, origin="cli", ts=TS, reason="not used"),
    ModelEvicted: ModelEvicted(
        node_id="node-a",
        model_id=MODEL,
        origin="node-a",
        ts=TS,
        bytes_freed=398 * 1024**2,
        budget_bytes=50 * GiB,
    ),
    InstanceRequested: InstanceRequested(
        instance_id="inst-1",
        model_id=MODEL,
        origin="api",
        ts=TS,
        placement='{"devices": ["node-a:gpu0", "node-b:cpu"], "tensor_split": [2, 1]}',
        replicas=2,
        context_length=4096,
    ),
    InstancePlaced: InstancePlaced(
        instance_id="inst-1", model_id=MODEL, origin="planner", ts=TS, shards=_shards()
    ),
    PlacementRejected: PlacementRejected(
        instance_id="inst-2",
        model_id="llama-70b",
        origin="planner",
        ts=TS,
        reason="needs 40.0 GiB; the cluster offers 24.0 GiB",
        needed_bytes=40 * GiB,
        available_bytes={"node-a": 16 * GiB, "node-b": 8 * GiB},
    ),
    InstanceDeleteRequested: InstanceDeleteRequested(
        instance_id="inst-1", origin="api", ts=TS, reason="user asked"
    ),
    InstanceDeleted: InstanceDeleted(
        instance_id="inst-1", origin="node-a", ts=TS, reason="delete requested"
    ),
    RunnerStateChanged: RunnerStateChanged(
        runner_id="inst-1-r0-0",
        instance_id="inst-1",
        node_id="node-a",
        origin="node-a",
        ts=TS,
        state="Loading",
        progress=0.42,
        endpoint="192.168.1.20:50052",
        pid=4242,
    ),
    TaskCreated: TaskCreated(
        task_id="task-1",
        model_id=MODEL,
        origin="api",
        ts=TS,
        kind="chat",
        messages=[
            ChatMessage(role="system", content="You are terse."),
            ChatMessage(role="user", content="Say hi — in ünïcødé 🐟"),
        ],
        params=SamplingParams(
            max_tokens=64, temperature=0.2, stop=["\n\n"], seed=7, logit_bias={15339: -5.0}
        ),
        user="alice",
        tools=[
            Tool(
                name="get_weather",
                parameters={"type": "object", "properties": {"city": {"type": "string"}}},
            )
        ],
        tool_choice=ToolChoice(mode="function", name="get_weather"),
        logprobs=2,
    ),
    EmbeddingsRequested: EmbeddingsRequested(
        task_id="task-1",
        model_id=MODEL,
        origin="api",
        ts=TS,
        texts=["The cat sat on the mat.", "Ünïcødé 🐟"],
        dimensions=256,
        user="alice",
    ),
    EmbeddingsComputed: EmbeddingsComputed(
        task_id="task-1",
        origin="node-a",
        ts=TS,
        start=0,
        total=2,
        dimensions=2,
        vectors="mpkZP83MTL8AAIA/AAAAAA==",
    ),
    ImageStepped: ImageStepped(
        task_id="task-1", origin="node-a", ts=TS, image=0, images=1, step=2, steps=4, attempt=0
    ),
    ImageGenerated: ImageGenerated(
        task_id="task-1",
        origin="node-a",
        ts=TS,
        index=0,
        png=ImagePart(
            sha256="c" * 64,
            media_type="image/png",
            width=256,
            height=256,
            bytes=132108,
            ref=PartRef(digest="d" * 64, parts=1, bytes=176248),
        ),
        seed=7,
        attempt=0,
    ),
    TaskStarted: TaskStarted(
        task_id="task-1",
        model_id=MODEL,
        origin="node-a",
        ts=TS,
        runner_id="inst-1-r0-0",
        instance_id="inst-1",
    ),
    ChunkGenerated: ChunkGenerated(
        task_id="task-1",
        origin="node-a",
        ts=TS,
        idx=3,
        text=" hello",
        token_id=15339,
        finish_reason=None,
        logprob=TokenLogprob(
            token=" hello",
            logprob=-0.5,
            bytes=tuple(b" hello"),
            top=(TopLogprob(token=" hi", logprob=-1.5, bytes=tuple(b" hi")),),
        ),
        tool_calls=(ToolCallDelta(index=0, id="call_1", name="get_weather"),),
    ),
    PromptScored: PromptScored(
        task_id="task-1",
        origin="node-a",
        ts=TS,
        start=0,
        total=2,
        tokens=(
            TokenLogprob(token="Hi", logprob=None, bytes=tuple(b"Hi")),
            TokenLogprob(token="!", logprob=-2.25, bytes=tuple(b"!")),
        ),
    ),
    TaskCompleted: TaskCompleted(
        task_id="task-1",
        model_id=MODEL,
        origin="node-a",
        ts=TS,
        runner_id="inst-1-r0-0",
        finish_reason="stop",
        usage=Usage(prompt_tokens=21, completion_tokens=5),
        timings=Timings(ttft_ms=35.5, tokens_per_s=61.25, total_ms=118.0),
    ),
    TaskFailed: TaskFailed(
        task_id="task-2",
        model_id=MODEL,
        origin="node-a",
        ts=TS,
        runner_id="inst-1-r0-0",
        error="prompt longer than the context (40000 > 32768 tokens)",
    ),
    TaskCancelled: TaskCancelled(
        task_id="task-3", model_id=MODEL, origin="api", ts=TS, reason="client disconnected"
    ),
    TaskForgotten: TaskForgotten(task_id="task-3", model_id=MODEL, origin="planner", ts=TS),
    ResponseStored: ResponseStored(
        response_id="resp_task-1",
        origin="api",
        ts=TS,
        task_id="task-1",
        model_id=MODEL,
        status="completed",
        response={"id": "resp_task-1", "object": "response", "output": [{"type": "message"}]},
        input_items=[{"type": "message", "id": "item_task-1_0", "role": "user"}],
        conversation=[
            ChatMessage(role="user", content="Say hi"),
            ChatMessage(role="assistant", content="Hi 🐟"),
        ],
    ),
    ResponseDeleted: ResponseDeleted(response_id="resp_task-1", origin="api", ts=TS),
    KeyAdded: KeyAdded(
        key_id="key-1",
        origin="cli",
        ts=TS,
        name="alice",
        role="user",
        digest="a" * 64,
        requests_per_minute=60,
    ),
    KeyRevoked: KeyRevoked(key_id="key-1", origin="cli", ts=TS, reason="left"),
    LogTailLost: LogTailLost(
        origin="projector:main",
        ts=TS,
        reader="projector:main",
        tracking_seq=102,
        stream_last_seq=98,
        dropped="events #99..#102 are gone: the log ends at #98",
        rebuilt_from_seq=0,
    ),
}

ALL_TYPES = pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)


def _union_members() -> set[type]:
    union, *_ = typing.get_args(Event)
    return set(typing.get_args(union))


def test_every_event_type_has_a_sample() -> None:
    missing = [c.__name__ for c in EVENT_TYPES if c not in SAMPLES]
    assert not missing, f"add a sample for {missing} to SAMPLES"
    for cls, sample in SAMPLES.items():
        assert type(sample) is cls


def test_catalogue_and_union_agree() -> None:
    assert _union_members() == set(EVENT_TYPES)
    assert len(set(EVENT_TYPES)) == len(EVENT_TYPES)
    names = [c.model_fields["type"].default for c in EVENT_TYPES]
    assert names == [c.__name__ for c in EVENT_TYPES]


@ALL_TYPES
def test_an_event_s_type_is_its_class_s_name(cls: type[EventBase]) -> None:
    """Written once, as the class: the field is made a Literal of it, which the union's
    discriminator needs, and which refuses another type's name."""
    assert SAMPLES[cls].type == cls.__name__
    annotation = cls.model_fields["type"].annotation
    assert typing.get_origin(annotation) is typing.Literal
    assert typing.get_args(annotation) == (cls.__name__,)
    doc = json.loads(SAMPLES[cls].to_json())
    other = next(c.__name__ for c in EVENT_TYPES if c is not cls)
    with pytest.raises(pydantic.ValidationError):
        cls.model_validate({**doc, "type": other})
    with pytest.raises(pydantic.ValidationError):
        cls(**{**dict(SAMPLES[cls]), "type": other})


@ALL_TYPES
def test_a_subject_names_its_event_s_type(cls: type[EventBase]) -> None:
    subject = SAMPLES[cls].subject
    assert subject_event_type(subject) == (None if cls.on_chunk_stream else cls.__name__)


def test_subjects_of_no_event_type() -> None:
    for subject in (
        "shoal.events.node.n1.Mystery",  # no such type
        "shoal.events.task.n1.NodeJoined",  # a node event's name on another aggregate
        "shoal.events.node.n1.extra.NodeJoined",  # one id too many
        "shoal.chunks.NodeJoined",  # a task id on the chunk stream
        "elsewhere.events.node.n1.NodeJoined",
        "NodeJoined",
    ):
        assert subject_event_type(subject) is None, subject


def test_catalogue_has_at_least_the_designed_events() -> None:
    designed = {
        "NodeJoined",
        "NodeLeft",
        "NodeTimedOut",
        "ResourceProfiled",
        "ModelAdded",
        "InstanceRequested",
        "InstancePlaced",
        "PlacementRejected",
        "InstanceDeleteRequested",
        "InstanceDeleted",
        "RunnerStateChanged",
        "TaskCreated",
        "TaskStarted",
        "ChunkGenerated",
        "TaskCompleted",
        "TaskFailed",
        "TaskCancelled",
    }
    assert designed <= {c.__name__ for c in EVENT_TYPES}


@ALL_TYPES
def test_subject(cls: type[EventBase]) -> None:
    event = SAMPLES[cls]
    subject = event.subject
    tokens = subject.split(".")
    assert all(tokens), subject
    assert "*" not in subject and ">" not in subject and " " not in subject
    if cls.on_chunk_stream:
        assert subject == "shoal.chunks.task-1"
        return
    assert subject.startswith(f"shoal.events.{cls.aggregate}.")
    assert tokens[-1] == cls.__name__
    assert len(tokens) == 3 + len(cls.subject_fields) + 1
    ids = [unescape_token(t) for t in tokens[3:-1]]
    assert ids == [str(getattr(event, f)) for f in cls.subject_fields]


@ALL_TYPES
def test_json_round_trip(cls: type[EventBase]) -> None:
    event = SAMPLES[cls]
    data = event.to_json()
    assert isinstance(data, bytes)
    back = parse_event(data)
    assert type(back) is cls
    assert back == event
    assert back.subject == event.subject
    # Also from str, and a second round trip gives the same bytes.
    assert parse_event(data.decode()) == event
    assert back.to_json() == data


@ALL_TYPES
def test_wire_json_is_plain_and_has_envelope(cls: type[EventBase]) -> None:
    doc = json.loads(SAMPLES[cls].to_json())
    assert doc["type"] == cls.__name__
    assert doc["v"] == SCHEMA_VERSION
    assert doc["origin"]
    assert isinstance(doc["event_id"], str) and doc["event_id"]
    assert datetime.fromisoformat(doc["ts"]) == TS
    # ClassVars are not fields and must not leak onto the wire.
    assert "aggregate" not in doc and "subject_fields" not in doc


@ALL_TYPES
def test_subject_pattern_names_the_aggregate(cls: type[EventBase]) -> None:
    pattern = cls.subject_pattern()
    if cls.on_chunk_stream:
        assert pattern == "shoal.chunks.<task_id>"
        return
    assert pattern.startswith(f"shoal.events.{cls.aggregate}.")
    assert pattern.endswith(f".{cls.__name__}")
    for f in cls.subject_fields:
        assert f"<{f}>" in pattern
    assert len(pattern.split(".")) == len(SAMPLES[cls].subject.split("."))


def test_task_subject_pattern_has_model_then_task() -> None:
    assert TaskCreated.subject_pattern() == "shoal.events.task.<model_id>.<task_id>.TaskCreated"
    assert NodeJoined.subject_pattern() == "shoal.events.node.<node_id>.NodeJoined"


def test_defaults_fill_the_envelope() -> None:
    a = NodeLeft(node_id="n", origin="n")
    b = NodeLeft(node_id="n", origin="n")
    assert a.event_id != b.event_id
    assert len(a.event_id) == 32
    assert a.v == SCHEMA_VERSION
    assert a.ts.tzinfo is not None
    assert abs(datetime.now(UTC) - a.ts) < timedelta(seconds=5)


def test_events_are_frozen() -> None:
    event = SAMPLES[TaskCreated]
    assert isinstance(event, TaskCreated)
    with pytest.raises(pydantic.ValidationError):
        event.task_id = "other"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        event.origin = "other"  # type: ignore[misc]
    assert event.params is not None
    with pytest.raises(pydantic.ValidationError):
        event.params.temperature = 2.0  # type: ignore[misc]
    placed = SAMPLES[InstancePlaced]
    assert isinstance(placed, InstancePlaced)
    with pytest.raises(pydantic.ValidationError):
        placed.shards[0].node_id = "elsewhere"  # type: ignore[misc]


def test_parse_rejects_invalid_json() -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        parse_event(b"{not json")
    assert exc.value.errors()[0]["type"] == "json_invalid"
    with pytest.raises(pydantic.ValidationError):
        parse_event(b"")


def test_parse_rejects_unknown_type() -> None:
    data = json.dumps({"type": "NodeExploded", "origin": "x", "node_id": "n"})
    with pytest.raises(pydantic.ValidationError) as exc:
        parse_event(data)
    assert exc.value.errors()[0]["type"] == "union_tag_invalid"


def test_parse_rejects_missing_type() -> None:
    with pytest.raises(pydantic.ValidationError) as exc:
        parse_event(json.dumps({"origin": "x", "node_id": "n"}))
    assert exc.value.errors()[0]["type"] == "union_tag_not_found"


def test_parse_rejects_non_object() -> None:
    for data in ("[1, 2]", '"NodeLeft"', "42", "null"):
        with pytest.raises(pydantic.ValidationError):
            parse_event(data)


def test_parsing_keeps_nothing_of_the_events_it_parsed() -> None:
    """Every event brings new ids: a parser that cached string values (pydantic's default)
    would hold a megabyte or more of them in a long-running process."""
    sample = SAMPLES[TaskStarted]

    def parse_new(n: int) -> None:
        for _ in range(n):
            parse_event(sample.model_copy(update={"task_id": uuid.uuid4().hex}).to_json())

    parse_new(1_000)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        parse_new(20_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 100_000, f"parsing 20,000 events kept {grown:,} bytes"


@pytest.mark.parametrize("field", ["origin", "node_id"])
def test_parse_rejects_missing_required_field(field: str) -> None:
    doc = json.loads(SAMPLES[NodeLeft].to_json())
    del doc[field]
    with pytest.raises(pydantic.ValidationError) as exc:
        parse_event(json.dumps(doc))
    err = exc.value.errors()[0]
    assert err["type"] == "missing"
    assert err["loc"][-1] == field


def test_parse_rejects_missing_nested_field() -> None:
    doc = json.loads(SAMPLES[TaskCompleted].to_json())
    del doc["usage"]["completion_tokens"]
    with pytest.raises(pydantic.ValidationError) as exc:
        parse_event(json.dumps(doc))
    assert exc.value.errors()[0]["loc"][-2:] == ("usage", "completion_tokens")


def test_parse_rejects_wrong_value() -> None:
    doc = json.loads(SAMPLES[RunnerStateChanged].to_json())
    doc["state"] = "Exploded"
    with pytest.raises(pydantic.ValidationError):
        parse_event(json.dumps(doc))
    doc = json.loads(SAMPLES[ChunkGenerated].to_json())
    doc["idx"] = "three"
    with pytest.raises(pydantic.ValidationError):
        parse_event(json.dumps(doc))


@ALL_TYPES
def test_unknown_extra_fields_are_ignored(cls: type[EventBase]) -> None:
    """Forward compatibility: a newer producer's extra fields do not break an older reader."""
    event = SAMPLES[cls]
    doc = json.loads(event.to_json())
    doc["added_in_v2"] = {"nested": [1, 2, 3]}
    doc["another"] = "x"
    back = parse_event(json.dumps(doc))
    assert back == event
    assert "added_in_v2" not in json.loads(back.to_json())


def test_old_event_without_defaulted_fields_still_parses() -> None:
    """Backward compatibility: fields with defaults may be absent in old logs."""
    doc = {
        "type": "NodeJoined",
        "event_id": "e1",
        "ts": "2026-01-01T00:00:00Z",
        "origin": "node-a",
        "node_id": "node-a",
    }
    event = parse_event(json.dumps(doc))
    assert isinstance(event, NodeJoined)
    assert event.v == SCHEMA_VERSION
    assert event.hostname == "" and event.addresses == []
    assert event.event_id == "e1"


def test_task_subjects_carry_the_model() -> None:
    for cls in (TaskCreated, TaskStarted, TaskCompleted, TaskFailed, TaskCancelled):
        event = SAMPLES[cls]
        tokens = event.subject.split(".")
        assert tokens[:3] == ["shoal", "events", "task"]
        assert unescape_token(tokens[3]) == MODEL
        assert unescape_token(tokens[4]) == getattr(event, "task_id")  # noqa: B009
    created = SAMPLES[TaskCreated]
    assert created.subject == "shoal.events.task.Qwen2%2E5-0%2E5B.task-1.TaskCreated"


async def test_model_tasks_filter_selects_that_models_tasks_on_real_nats(nc: Client) -> None:
    got: list[Msg] = []
    done = asyncio.Event()

    async def on_task(msg: Msg) -> None:
        got.append(msg)

    async def on_sentinel(msg: Msg) -> None:
        done.set()

    sub = await nc.subscribe(TaskCreated.filter_for(MODEL), cb=on_task)
    sentinel = await nc.subscribe("shoal.test.sentinel", cb=on_sentinel)
    wanted = [
        TaskCreated(task_id="t.1", model_id=MODEL, origin="api"),
        TaskCreated(task_id="t 2", model_id=MODEL, origin="api"),
    ]
    unwanted: list[EventBase] = [
        TaskCreated(task_id="t3", model_id="smollm2-135m", origin="api"),
        TaskCreated(task_id="t4", model_id="Qwen2", origin="api"),
        TaskCreated(task_id="t5", model_id="Qwen2.5-0.5B-Instruct", origin="api"),
        TaskStarted(task_id="t.1", model_id=MODEL, origin="n", runner_id="r", instance_id="i"),
        NodeJoined(node_id=MODEL, origin="n"),
    ]
    for e in [unwanted[0], wanted[0], *unwanted[1:], wanted[1]]:
        await nc.publish(e.subject, e.to_json())
    # Messages from one connection arrive in order: once the sentinel is in, so is the rest.
    await nc.publish("shoal.test.sentinel", b"")
    await asyncio.wait_for(done.wait(), 5)
    await sub.unsubscribe()
    await sentinel.unsubscribe()
    assert [m.subject for m in got] == [e.subject for e in wanted]
    assert [parse_event(m.data) for m in got] == wanted


async def test_chat_and_embed_runners_of_one_model_filter_apart_on_real_nats(nc: Client) -> None:
    """An embed runner's filter takes its model's EmbeddingsRequested and nothing else; a chat
    runner's (model_tasks_filter) takes none of them."""
    embeds: list[Msg] = []
    chats: list[Msg] = []
    done = asyncio.Event()

    async def on_embed(msg: Msg) -> None:
        embeds.append(msg)

    async def on_chat(msg: Msg) -> None:
        chats.append(msg)

    async def on_sentinel(msg: Msg) -> None:
        done.set()

    subs = [
        await nc.subscribe(EmbeddingsRequested.filter_for(MODEL), cb=on_embed),
        await nc.subscribe(TaskCreated.filter_for(MODEL), cb=on_chat),
        await nc.subscribe("shoal.test.sentinel", cb=on_sentinel),
    ]
    embed = EmbeddingsRequested(task_id="e.1", model_id=MODEL, origin="api", texts=["x"])
    chat = TaskCreated(task_id="c1", model_id=MODEL, origin="api")
    other = EmbeddingsRequested(task_id="e2", model_id="smollm2-135m", origin="api", texts=["x"])
    for e in (embed, chat, other):
        await nc.publish(e.subject, e.to_json())
    await nc.publish("shoal.test.sentinel", b"")
    await asyncio.wait_for(done.wait(), 5)
    for sub in subs:
        await sub.unsubscribe()
    assert [parse_event(m.data) for m in embeds] == [embed]
    assert [parse_event(m.data) for m in chats] == [chat]
    assert embed.subject == "shoal.events.task.Qwen2%2E5-0%2E5B.e%2E1.EmbeddingsRequested"


def test_the_chunk_stream_s_types_are_told_apart_unparsed() -> None:
    for cls in (ChunkGenerated, PromptScored, EmbeddingsComputed, ImageStepped, ImageGenerated):
        assert chunk_stream_type(SAMPLES[cls].to_json()) == cls.__name__


def test_an_image_task_is_a_task_created_and_older_tasks_read_as_before() -> None:
    """An image task is a TaskCreated of kind image with its parameters; a TaskCreated logged
    before images existed (no `image`) reads as it did."""
    asked = TaskCreated(
        task_id="t",
        model_id="sd-turbo",
        origin="api",
        kind="image",
        prompt="a cat",
        image=ImageParams(n=2, width=512, height=256, steps=4, seed=9, partial_images=1),
    )
    again = parse_event(asked.to_json())
    assert again == asked
    old = json.loads(SAMPLES[TaskCreated].to_json())
    old.pop("image", None)
    read = parse_event(json.dumps(old))
    assert isinstance(read, TaskCreated) and read.image is None and read.kind == "chat"
