"""Prompt parts stored once by digest (bus/stores/parts.py, bus/stores/claim_check.py), on a real
nats-server."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from nats.js import JetStreamContext

from bus.payload import max_payload
from bus.stores.claim_check import (
    TooLarge,
    checked_in,
    resolved,
    response_checked_in,
    response_resolved,
)
from bus.stores.parts import (
    ENTRY_BYTES,
    PARTS_STREAM,
    PartMissing,
    PartStore,
    chain,
    part_subject,
    read_part,
    ref_of,
)
from events.catalogue import ResponseStored, TaskCreated
from events.records import ChatMessage, Tool

TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_a_chain_names_its_parent_and_its_digest_is_its_bytes() -> None:
    parts = chain(["a", "b", "c"])
    assert [p.parent for p in parts] == [None, parts[0].digest, parts[1].digest]
    assert all(hashlib.sha256(p.body).hexdigest() == p.digest for p in parts)
    # A longer conversation starts with the same parts: only the new ones are new.
    assert [p.digest for p in chain(["a", "b", "c", "d"])][:3] == [p.digest for p in parts]
    ref = ref_of(parts)
    assert ref is not None and ref.digest == parts[-1].digest and ref.parts == 3
    assert ref.bytes == sum(len(p.body) for p in parts)
    assert read_part(parts[1].digest, parts[1].body) == parts[1]
    with pytest.raises(PartMissing, match="damaged"):
        read_part(parts[1].digest, parts[0].body)
    assert ref_of([]) is None


async def _stored(js: JetStreamContext) -> tuple[int, int]:
    state = (await js.stream_info(PARTS_STREAM)).state
    return state.messages, state.bytes


async def test_the_next_turn_stores_only_its_new_messages(js: JetStreamContext) -> None:
    store = PartStore(js)
    first = await store.put(TURN)
    assert first is not None and first.parts == 2
    messages, _ = await _stored(js)
    assert messages == 2
    second = await store.put([*TURN, {"role": "user", "content": "and then?"}])
    assert second is not None and second.parts == 3
    assert (await _stored(js))[0] == 3
    # Another process (no memory of what was stored) stores them again: still one copy each.
    await PartStore(js).put([*TURN, {"role": "user", "content": "and then?"}])
    assert (await _stored(js))[0] == 3
    reader = PartStore(js)
    assert await reader.get(second) == [*TURN, {"role": "user", "content": "and then?"}]
    assert await reader.get(first) == TURN


async def test_a_missing_or_damaged_part_is_said(js: JetStreamContext) -> None:
    store = PartStore(js)
    ref = await store.put(TURN)
    assert ref is not None
    await js.purge_stream(PARTS_STREAM, subject=part_subject(ref.digest))
    with pytest.raises(PartMissing, match="not stored"):
        await PartStore(js).get(ref)
    await js.publish(part_subject(ref.digest), b'{"parent":null,"value":"forged"}')
    with pytest.raises(PartMissing, match="damaged"):
        await PartStore(js).get(ref)


async def test_a_task_and_a_response_go_out_as_parts_and_come_back_whole(
    js: JetStreamContext,
) -> None:
    messages = [ChatMessage(role="user", content="What is the weather?")]
    tools = [Tool(name="get_weather", description="The weather.")]
    task = TaskCreated(task_id="t", model_id="m", origin="api", messages=messages, tools=tools)
    store = PartStore(js)
    out = await checked_in(store, task)
    assert out.messages is None and out.tools == [] and out.messages_ref and out.tools_ref
    assert len(out.to_json()) < len(task.to_json()) + 200  # names, not content
    back = await resolved(PartStore(js), out)
    assert back.messages == messages and back.tools == tools
    assert back.messages_ref is None and back.tools_ref is None
    assert back.model_dump(exclude={"event_id"}) == task.model_dump(exclude={"event_id"})

    stored = ResponseStored(
        response_id="r", origin="api", conversation=messages, input_items=[{"id": "i1"}]
    )
    out_r = await response_checked_in(store, stored)
    assert out_r.conversation == [] and out_r.input_items == [] and out_r.conversation_ref
    assert await response_resolved(PartStore(js), out_r) == stored


async def test_a_tool_schema_comes_back_in_the_order_it_was_sent(js: JetStreamContext) -> None:
    """A chat template renders a tool's schema as it is, and its grammar orders the arguments
    by it: the runner reads the keys in the client's order."""
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    tools = [Tool(name="f", description="F.", parameters=schema)]
    messages = [ChatMessage(role="user", content="hi")]
    task = TaskCreated(task_id="t", model_id="m", origin="api", messages=messages, tools=tools)
    served = await resolved(PartStore(js), await checked_in(PartStore(js), task))
    assert json.dumps(served.tools[0].parameters) == json.dumps(schema)
    assert served.messages == messages


async def test_a_message_too_large_for_nats_is_named(js: JetStreamContext) -> None:
    huge = "x" * max_payload(js)
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="user", content=huge)]
    task = TaskCreated(task_id="t", model_id="m", origin="api", messages=messages)
    with pytest.raises(TooLarge) as caught:
        await checked_in(PartStore(js), task)
    assert (caught.value.field, caught.value.index) == ("messages", 1)


async def test_a_one_turn_request_leaves_the_cache_alone(js: JetStreamContext) -> None:
    """The cache keeps what a conversation's next turn reads again: a chain's earlier parts, not
    its last one (a one-turn request's message is read once), within its bytes."""
    store = PartStore(js)
    one = await store.put([{"role": "user", "content": "once"}])
    assert one is not None
    reader = PartStore(js, cache_bytes=2 * (ENTRY_BYTES + 100))
    assert await reader.get(one) == [{"role": "user", "content": "once"}]
    assert reader.cached_bytes == 0
    turns = [{"role": "user", "content": f"turn {i}"} for i in range(4)]
    refs = [await store.put(turns[: i + 1]) for i in range(4)]
    for i, ref in enumerate(refs):
        assert ref is not None
        assert await reader.get(ref) == turns[: i + 1]
    # The earlier turns were kept, the oldest gone past the bound.
    assert 0 < reader.cached_bytes <= 2 * (ENTRY_BYTES + 100)


async def _last_seq(js: JetStreamContext) -> int:
    return (await js.stream_info(PARTS_STREAM)).state.last_seq


async def test_what_a_process_remembers_storing_is_bounded_and_ages_with_the_log(
    js: JetStreamContext,
) -> None:
    """A part stored is not stored again while it is young; once older than the renewal age it
    is stored again (renewed) and no longer remembered until then; and only the most recently
    stored ``known_max`` digests are remembered, however many requests came."""

    async def renewal() -> float:
        return 0.3

    store = PartStore(js, renewal=renewal, known_max=5)
    await store.put(TURN)
    before = await _last_seq(js)
    await store.put(TURN)  # young: nothing goes out
    assert await _last_seq(js) == before and store.known == 2
    await asyncio.sleep(0.35)
    await store.put([{"role": "user", "content": "new"}])
    assert store.known == 1  # the two aged digests were forgotten as the new one was stored
    await store.put(TURN)  # aged: stored again
    assert await _last_seq(js) == before + 3
    for i in range(20):
        await store.put([{"role": "user", "content": f"request {i}"}])
    assert store.known == 5
    before = await _last_seq(js)
    await store.put([{"role": "user", "content": "request 19"}])  # remembered: not stored
    await store.put([{"role": "user", "content": "request 0"}])  # forgotten: stored again
    assert await _last_seq(js) == before + 1
