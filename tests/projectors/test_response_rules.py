"""Stored responses of the Responses API in the projection: a later ``ResponseStored`` replaces
an earlier one, ``ResponseDeleted`` leaves only a tombstone, which nothing stores again; the
projector writes the same rows as the pure fold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from events.catalogue import Event, ResponseDeleted, ResponseStored
from events.records import ChatMessage, ToolCall
from projectors import database
from projectors.rows import ResponseRow
from projectors.rules import fold
from projectors.state import ClusterState, Put
from projectors.store import check_storable
from tests.projectors.helpers import (
    db_rows,
    memory_rows,
    publish_all,
    running_projector,
    wait_for_seq,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def stored(seconds: float, status: str = "completed", **fields: Any) -> ResponseStored:
    response = {
        "id": "resp_t",
        "object": "response",
        "status": status,
        "temperature": 0.5,
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi ünï 🐟"}]}],
    }
    return ResponseStored.model_validate(
        {
            "response_id": "resp_t",
            "origin": "api",
            "ts": T0 + timedelta(seconds=seconds),
            "task_id": "t",
            "model_id": "m",
            "status": status,
            "response": response,
            "input_items": [
                {
                    "type": "message",
                    "id": "item_t_0",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hello"}],
                }
            ],
            "conversation": [
                ChatMessage(role="user", content="Hello"),
                ChatMessage(
                    role="assistant", tool_calls=[ToolCall(id="c", name="f", arguments="{}")]
                ),
            ],
            **fields,
        }
    )


def deleted(seconds: float) -> ResponseDeleted:
    return ResponseDeleted(response_id="resp_t", origin="api", ts=T0 + timedelta(seconds=seconds))


def row_of(state: ClusterState) -> ResponseRow:
    row = state.tables[ResponseRow.TABLE][("resp_t",)]
    assert isinstance(row, ResponseRow)
    return row


def test_a_stored_response_is_a_row_with_its_conversation() -> None:
    row = row_of(fold([stored(1)]))
    assert (row.status, row.task_id, row.model_id) == ("completed", "t", "m")
    assert row.created_at == row.updated_at == T0 + timedelta(seconds=1)
    assert (
        row.response is not None and row.response["output"][0]["content"][0]["text"] == "Hi ünï 🐟"
    )
    assert row.input_items is not None and row.input_items[0]["id"] == "item_t_0"
    conversation = [ChatMessage.model_validate(m) for m in row.conversation or []]
    assert conversation[1].tool_calls == [ToolCall(id="c", name="f", arguments="{}")]


def test_a_later_store_replaces_it_and_keeps_when_it_was_created() -> None:
    row = row_of(fold([stored(1, "queued"), stored(5, "completed")]))
    assert row.status == "completed"
    assert row.created_at == T0 + timedelta(seconds=1)
    assert row.updated_at == T0 + timedelta(seconds=5)


def test_a_deleted_response_keeps_only_a_tombstone_that_nothing_stores_again() -> None:
    state = fold([stored(1, "in_progress"), deleted(2)])
    row = row_of(state)
    assert row.deleted_at == T0 + timedelta(seconds=2) and row.status == "deleted"
    assert (row.response, row.input_items, row.conversation) == (None, None, None)
    assert (row.task_id, row.created_at) == ("t", T0 + timedelta(seconds=1))
    # A background response that finished after its deletion stays deleted.
    assert row_of(fold([stored(3)], state)) == row
    assert row_of(fold([deleted(4)], state)) == row


def test_the_rows_are_storable() -> None:
    for state in (fold([stored(1)]), fold([stored(1), deleted(2)])):
        check_storable([Put(row_of(state))])


async def test_the_projector_writes_what_the_fold_makes(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    await database.upgrade(engine)
    other = stored(2, response_id="resp_u", task_id="u")
    events: list[Event] = [stored(1, "queued"), stored(3), other, deleted(4)]
    seq = await publish_all(js, events)
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, seq)
    rows = await db_rows(engine)
    assert rows["responses"] == memory_rows(fold(events))["responses"]
    assert [r["response_id"] for r in rows["responses"]] == ["resp_t", "resp_u"]
    assert rows["responses"][1]["response"]["output"][0]["content"][0]["text"] == "Hi ünï 🐟"
