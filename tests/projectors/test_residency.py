"""The projector keeps what is live in memory and reads history back only when an event names
it (projectors/residency.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from events.catalogue import (
    Event,
    NodeJoined,
    ResponseDeleted,
    ResponseStored,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskForgotten,
)
from events.records import ChatMessage, Timings, Usage
from projectors.residency import missing, named
from projectors.rows import ResponseRow, TaskRow
from projectors.rules import fold
from tests.projectors.helpers import (
    db_rows,
    live_part,
    memory_rows,
    publish_all,
    running_projector,
    wait_for_seq,
)

AT = datetime(2026, 1, 1, tzinfo=UTC)


def created(task_id: str) -> TaskCreated:
    messages = [ChatMessage(role="user", content="hi")]
    return TaskCreated(task_id=task_id, model_id="m", origin="t", messages=messages, ts=AT)


def completed(task_id: str) -> TaskCompleted:
    return TaskCompleted(
        task_id=task_id,
        model_id="m",
        origin="r",
        runner_id="r1",
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(ttft_ms=1.0, tokens_per_s=2.0, total_ms=3.0),
        ts=AT,
    )


def test_the_rows_an_event_names_are_tasks_and_responses_only() -> None:
    events: list[Event] = [
        created("t1"),
        completed("t2"),
        ResponseDeleted(response_id="r1", origin="api"),
        NodeJoined(node_id="n", origin="n"),
    ]
    assert named(events) == {TaskRow.TABLE: {("t1",), ("t2",)}, ResponseRow.TABLE: {("r1",)}}
    state = fold([created("t1")])
    assert missing(state, events) == {TaskRow.TABLE: [("t2",)], ResponseRow.TABLE: [("r1",)]}


def test_forgetting_history_keeps_what_is_live() -> None:
    stored = ResponseStored(response_id="r1", origin="api", task_id="t1")
    state = fold([created("t1"), completed("t1"), created("t2"), stored])
    state.forget_history()
    assert list(state.task_rows) == [("t2",)]
    assert state.response_rows == {}


async def test_a_restarted_projector_reads_no_ended_task_until_one_is_named(
    js: JetStreamContext, engine: AsyncEngine
) -> None:
    """200 tasks ended, one still pending: a projector started afterwards holds the pending one
    only. A late event about an ended task (a cancel after it completed: kept completed; a
    stored response deleted; a task forgotten) reads its row, changes what the full fold
    changes, and lets it go."""
    ended = [e for i in range(200) for e in (created(f"t{i}"), completed(f"t{i}"))]
    stored = ResponseStored(response_id="r1", origin="api", task_id="t0", model_id="m")
    history: list[Event] = [*ended, created("open"), stored]
    last = await publish_all(js, history)
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, last)
        assert list(projector.state.task_rows) == [("open",)]
    async with running_projector(js, engine) as projector:
        assert list(projector.state.task_rows) == [("open",)]
        assert projector.state.response_rows == {}
        late: list[Event] = [
            TaskCancelled(task_id="t7", model_id="m", origin="api", ts=AT),
            ResponseDeleted(response_id="r1", origin="api", ts=AT),
            TaskForgotten(task_id="t8", model_id="m", origin="planner", ts=AT),
        ]
        last = await publish_all(js, late)
        await wait_for_seq(projector, last)
        everything = memory_rows(fold([*history, *late]))
        assert await db_rows(engine) == everything
        assert "t8" not in {row["task_id"] for row in everything["tasks"]}
        assert memory_rows(projector.state) == live_part(everything)
