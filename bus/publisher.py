"""Publishing events to JetStream.

``publish`` waits for the stream's ack, so a caller knows the fact is stored (and its
sequence). ``ChunkPublisher`` is the high-rate path for token chunks: it keeps many publishes in
flight and only waits when asked to ``flush``, which keeps a runner's token loop from waiting a
round trip per token.

Both publish again what JetStream did not acknowledge for a while (``retry_for``, 30 s by
default): on a NATS cluster a stream has no leader for a few seconds after its leader's server
is lost, and publishes then go unanswered ("no responders", or no ack at all). Publishing again
is safe because every message carries its ``Nats-Msg-Id``: one that was stored after all is
dropped as a duplicate (within the streams' duplicate window, 2 minutes by default).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from bus.leaderless import RETRY_FOR_S, ask_again, retryable
from bus.payload import check_size
from events.catalogue import EventBase

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"

# How long one attempt waits for its ack.
ACK_TIMEOUT_S = 5.0


class Publisher:
    def __init__(
        self, js: JetStreamContext, timeout: float = ACK_TIMEOUT_S, retry_for: float = RETRY_FOR_S
    ) -> None:
        self._js = js
        self._timeout = timeout
        self._retry_for = retry_for

    async def publish(self, event: EventBase, msg_id: str | None = None) -> PubAck:
        """Store ``event`` and return JetStream's ack. ``msg_id`` (default: the event id) is the
        de-duplication key: decisions pass a deterministic one, so that two deciders, or one
        decision made twice, store one event. Sent again, with the same id, while JetStream
        cannot store it, for up to ``retry_for`` seconds; then the last error is raised."""
        headers = {MSG_ID_HEADER: msg_id or event.event_id}
        payload = event.to_json()
        # Refused here: over the server's max_payload, the server would close the connection.
        check_size(self._js, event.subject, payload, headers)
        return await ask_again(
            lambda: self._js.publish(
                event.subject, payload, timeout=self._timeout, headers=dict(headers)
            ),
            within_s=self._retry_for,
            pause_s=0.05,
            max_pause_s=1.0,
            what=f"publishing {event.subject}",
        )


@dataclass
class _Sent:
    subject: str
    payload: bytes
    msg_id: str
    first_sent_at: float
    sent_at: float
    error: BaseException | None = None  # why the previous attempt failed


class ChunkPublisher:
    """Pipelined publishing: up to ``max_in_flight`` unacknowledged publishes at once."""

    def __init__(
        self,
        js: JetStreamContext,
        max_in_flight: int = 256,
        retry_for: float = RETRY_FOR_S,
        ack_timeout: float = ACK_TIMEOUT_S,
    ) -> None:
        self._js = js
        self._in_flight: dict[asyncio.Future[PubAck], _Sent] = {}
        self._max_in_flight = max_in_flight
        self._retry_for = retry_for
        self._ack_timeout = ack_timeout

    async def publish(self, event: EventBase, msg_id: str | None = None) -> None:
        """Send ``event``; ``msg_id`` (default: the event id) as ``Publisher.publish``."""
        if len(self._in_flight) >= self._max_in_flight:
            await self._settle(wait_all=False, timeout=None)
        payload = event.to_json()
        msg_id = msg_id or event.event_id
        check_size(self._js, event.subject, payload, {MSG_ID_HEADER: msg_id})
        now = asyncio.get_running_loop().time()
        await self._send(_Sent(event.subject, payload, msg_id, now, now))

    async def flush(self, timeout: float | None = None) -> list[PubAck]:
        """Wait for every publish in flight, publishing again those JetStream did not store
        (for up to ``retry_for`` seconds after each was first sent, or ``timeout`` in all);
        raises the error of one that could not be stored."""
        return await self._settle(wait_all=True, timeout=timeout)

    async def _send(self, sent: _Sent) -> None:
        fut = await self._js.publish_async(
            sent.subject, sent.payload, headers={MSG_ID_HEADER: sent.msg_id}
        )
        self._in_flight[fut] = sent

    async def _settle(self, *, wait_all: bool, timeout: float | None) -> list[PubAck]:
        """Collect acks until all are in (``wait_all``) or at least one (to make room),
        publishing again what failed or was not acknowledged within ``ack_timeout``."""
        loop = asyncio.get_running_loop()
        stop_at = None if timeout is None else loop.time() + timeout
        acks: list[PubAck] = []
        while self._in_flight and (wait_all or not acks):
            now = loop.time()
            wait = min(s.sent_at for s in self._in_flight.values()) + self._ack_timeout - now
            if stop_at is not None:
                wait = min(wait, stop_at - now)
            done, _ = await asyncio.wait(
                self._in_flight, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED
            )
            now = loop.time()
            again: list[_Sent] = []
            for fut, sent in list(self._in_flight.items()):
                if fut in done and (exc := fut.exception()) is None:
                    del self._in_flight[fut]
                    acks.append(fut.result())
                elif fut in done or now >= sent.sent_at + self._ack_timeout:
                    del self._in_flight[fut]
                    fut.cancel()  # not acked in time: frees its slot in the client's table
                    sent.error = exc if fut in done else nats.errors.TimeoutError()
                    again.append(sent)
            out_of_time = stop_at is not None and now >= stop_at
            for sent in again:
                assert sent.error is not None
                late = now >= sent.first_sent_at + self._retry_for
                if not retryable(sent.error) or late or out_of_time:
                    self._drop_all()
                    raise sent.error
            if out_of_time and self._in_flight:
                errors = [s.error for s in self._in_flight.values() if s.error is not None]
                self._drop_all()
                raise errors[0] if errors else nats.errors.TimeoutError()
            if again:
                log.info("publishing %d chunk(s) again: %r", len(again), again[0].error)
                await asyncio.sleep(0.2)
                for sent in again:
                    sent.sent_at = loop.time()
                    await self._send(sent)
        return acks

    def _drop_all(self) -> None:
        """After a failure nothing in flight is waited for any more."""
        for fut in self._in_flight:
            fut.cancel()
        self._in_flight.clear()
