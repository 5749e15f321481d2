"""Publishing events to JetStream.

``publish`` waits for the stream's ack, so a caller knows the fact is stored (and its
sequence). ``ChunkPublisher`` is the high-rate path for token chunks: it keeps many publishes in
flight and only waits when asked to ``flush``, which keeps a runner's token loop from waiting a
round trip per token.
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.api import PubAck

from bus.events import EventBase

MSG_ID_HEADER = "Nats-Msg-Id"


class Publisher:
    def __init__(self, js: JetStreamContext, timeout: float = 5.0) -> None:
        self._js = js
        self._timeout = timeout

    async def publish(self, event: EventBase, msg_id: str | None = None) -> PubAck:
        """Store ``event`` and return JetStream's ack. ``msg_id`` (default: the event id) is the
        de-duplication key: decisions pass a deterministic one, so that two deciders, or one
        decision made twice, store one event."""
        return await self._js.publish(
            event.subject,
            event.to_json(),
            timeout=self._timeout,
            headers={MSG_ID_HEADER: msg_id or event.event_id},
        )


class ChunkPublisher:
    """Pipelined publishing: up to ``max_in_flight`` unacknowledged publishes at once."""

    def __init__(self, js: JetStreamContext, max_in_flight: int = 256) -> None:
        self._js = js
        self._in_flight: set[asyncio.Future[PubAck]] = set()
        self._max_in_flight = max_in_flight

    async def publish(self, event: EventBase) -> None:
        if len(self._in_flight) >= self._max_in_flight:
            await self._wait_some()
        fut = await self._js.publish_async(
            event.subject, event.to_json(), headers={MSG_ID_HEADER: event.event_id}
        )
        self._in_flight.add(fut)

    async def flush(self, timeout: float = 10.0) -> list[PubAck]:
        """Wait for every publish in flight; raises if any was not stored."""
        pending, self._in_flight = self._in_flight, set()
        if not pending:
            return []
        async with asyncio.timeout(timeout):
            return list(await asyncio.gather(*pending))

    async def _wait_some(self) -> None:
        done, self._in_flight = await asyncio.wait(
            self._in_flight, return_when=asyncio.FIRST_COMPLETED
        )
        for fut in done:
            fut.result()  # surface a failed publish now rather than at flush
