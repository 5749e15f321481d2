"""What the projector keeps in memory, and what it reads back when an event needs it.

Memory holds what is live, whatever the length of the history: nodes, devices, models,
instances, runners, and the tasks that have not ended. Ended tasks and stored responses are in
the database only. Before a batch of events is folded, the rows its events name that memory
does not hold are read (``missing``: an event about a task that ended, a stored response
deleted); once the batch is written, memory lets them go again
(``ClusterState.forget_history``). The rules stay pure: they find every row they read in the
state they are given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from events.catalogue import (
    EmbeddingsRequested,
    Event,
    ResponseDeleted,
    ResponseStored,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
    TaskStarted,
)
from projectors.rows import ResponseRow, TaskRow
from projectors.state import ClusterState
from projectors.store import read_rows


def named(events: Iterable[Event]) -> dict[str, set[tuple[Any, ...]]]:
    """The keys of the history rows (tasks, stored responses) these events are about."""
    keys: dict[str, set[tuple[Any, ...]]] = {TaskRow.TABLE: set(), ResponseRow.TABLE: set()}
    for event in events:
        match event:
            case (
                TaskCreated()
                | EmbeddingsRequested()
                | TaskStarted()
                | TaskCompleted()
                | TaskFailed()
                | TaskCancelled()
                | TaskForgotten()
            ):
                keys[TaskRow.TABLE].add((event.task_id,))
            case ResponseStored() | ResponseDeleted():
                keys[ResponseRow.TABLE].add((event.response_id,))
    return keys


def missing(state: ClusterState, events: Iterable[Event]) -> dict[str, list[tuple[Any, ...]]]:
    """The keys, by table, of the rows these events are about that ``state`` does not hold:
    those to read from the database before folding them."""
    return {
        table: sorted(k for k in keys if k not in state.tables[table])
        for table, keys in named(events).items()
        if keys
    }


async def read_history(engine: AsyncEngine, state: ClusterState, events: Iterable[Event]) -> None:
    """Put into ``state`` the history rows these events are about that it does not hold."""
    wanted = missing(state, events)
    if not any(wanted.values()):
        return
    async with engine.connect() as conn:
        for table, keys in wanted.items():
            for row in await read_rows(conn, table, keys):
                state.put(row)
