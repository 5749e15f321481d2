"""Watching the event log from a test: every event, parsed, with a way to wait for one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from events.catalogue import ChunkGenerated, Event, parse_event

E = TypeVar("E")


class EventLog:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.chunks: dict[str, list[ChunkGenerated]] = {}
        self._changed = asyncio.Condition()
        self._subs: list[Any] = []

    async def start(self, js: JetStreamContext) -> EventLog:
        for subject in ("shoal.events.>", "shoal.chunks.>"):
            self._subs.append(
                await js.subscribe(
                    subject,
                    cb=self._on_msg,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.ALL,
                )
            )
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        event = parse_event(msg.data)
        async with self._changed:
            if isinstance(event, ChunkGenerated):
                self.chunks.setdefault(event.task_id, []).append(event)
            else:
                self.events.append(event)
            self._changed.notify_all()

    def of(self, kind: type[E], where: Callable[[E], bool] = lambda _: True) -> list[E]:
        return [e for e in self.events if isinstance(e, kind) and where(e)]

    async def wait_for(
        self, kind: type[E], where: Callable[[E], bool] = lambda _: True, timeout: float = 60
    ) -> E:
        """The first event of ``kind`` matching ``where``, waiting for it if needed."""
        async with asyncio.timeout(timeout), self._changed:
            while True:
                found = self.of(kind, where)
                if found:
                    return found[0]
                await self._changed.wait()

    async def wait_count(
        self, kind: type[E], where: Callable[[E], bool], n: int, timeout: float = 60
    ) -> list[E]:
        async with asyncio.timeout(timeout), self._changed:
            while len(found := self.of(kind, where)) < n:
                await self._changed.wait()
            return found

    async def wait_chunks(self, task_id: str, timeout: float = 60) -> list[ChunkGenerated]:
        """All chunks of a task, once its last one (with a finish reason) has come."""
        async with asyncio.timeout(timeout), self._changed:
            while not any(c.finish_reason for c in self.chunks.get(task_id, [])):
                await self._changed.wait()
            return sorted(self.chunks[task_id], key=lambda c: c.idx)
