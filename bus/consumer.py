"""Durable pull consumers with explicit ack, and the dead-letter rule.

A message that is not valid JSON, names an unknown event type or fails validation is never
handed to the caller: it is republished to ``shoal.deadletter.<stream>`` with the reason in
headers, terminated on its consumer (so it is not redelivered) and counted. The consumer goes
on with the next message. A dead letter keeps the message as it was, unless the message and the
headers together would exceed the server's ``max_payload``: then it keeps the message's first
bytes and says how long it was in ``Shoal-Original-Size``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from bus.leaderless import NO_LEADER_PAUSE_S
from bus.log_position import consumer_past_end, digest
from bus.payload import max_payload, message_size
from bus.puller import ConsumerGone, NoResponders, Puller
from events.catalogue import Event, parse_event
from events.subjects import deadletter_subject

log = logging.getLogger(__name__)


# Headers on a dead letter.
REASON_HEADER = "Shoal-Deadletter-Reason"
SUBJECT_HEADER = "Shoal-Original-Subject"
STREAM_HEADER = "Shoal-Original-Stream"
SEQ_HEADER = "Shoal-Original-Seq"
CONSUMER_HEADER = "Shoal-Consumer"
SIZE_HEADER = "Shoal-Original-Size"  # only on a dead letter that keeps part of the message

MAX_REASON_CHARS = 1000  # a reason is a line for people; an exception's repr may be anything

# How long a service's pull request waits for an event: each one costs the nats-server and the
# client some CPU, taken from a runner on the same machine (idle, 0.5-1 s made six a second in
# `shoal up`), and a client reconnected after a nats-server restart notices a lost one only
# when it times out.
PULL_WAIT_S = 2.0


@dataclass(frozen=True)
class Delivered:
    """A parsed event with where it sits in its stream."""

    event: Event
    msg: Msg
    stream_seq: int

    @property
    def stored_at(self) -> datetime:
        """When the stream stored it (read from the reply subject only when asked)."""
        return self.msg.metadata.timestamp

    async def ack(self) -> None:
        await self.msg.ack()


def stream_seq(msg: Msg) -> int:
    """The message's sequence in its stream, from its reply subject: what every fetched
    message needs, without the rest of ``msg.metadata`` (a dataclass and a datetime each)."""
    tokens = Msg.Metadata._get_metadata_fields(msg.reply)
    return int(tokens[5] if len(tokens) == _V1_ACK_TOKENS else tokens[Msg.Ack.StreamSeq])


# $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>; newer
# servers may add a domain and an account hash (nats-py's Msg.Ack indexes those).
_V1_ACK_TOKENS = 9


@dataclass
class ConsumerStats:
    delivered: int = 0
    dead_letters: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)


def describe_invalid(exc: ValidationError) -> str:
    """A one-line reason: 'invalid JSON', 'unknown event type X' or the first field errors."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"invalid JSON: {first['msg']}"
    if first["type"] == "union_tag_invalid":
        return f"unknown event type: {first.get('input', {}).get('type')!r}"
    if first["type"] == "union_tag_not_found":
        return "no 'type' field"
    parts = [
        f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
        for e in errors[:3]
    ]
    return "invalid event: " + "; ".join(parts)


def _ascii(text: str) -> str:
    """A header value in ASCII: nats-py reads other header values back garbled (as
    ``email.header.Header`` objects), so non-ASCII characters are sent escaped (``\\xa1``)."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


class EventConsumer:
    """One durable pull consumer on ``stream`` filtered by ``filter_subject``.

    ``memory``: the server keeps the consumer's position in memory, for a consumer whose owner
    keeps its own (the projector, in its database). After a restart of the server ``fetch``
    raises ``ConsumerGone`` (as for a deleted consumer), and the owner makes it again from
    where it got to.

    ``ack_all``: an ack acknowledges every message delivered before it too (JetStream's
    ``AckPolicy.ALL``), for an owner that takes messages in order and acks what it fetched at
    once (``ack_fetched``); its dead letters are acknowledged by that ack too."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        durable: str,
        filter_subject: str,
        *,
        deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
        opt_start_seq: int | None = None,
        ack_wait: float = 30.0,
        max_ack_pending: int = 10_000,
        memory: bool = False,
        ack_all: bool = False,
    ) -> None:
        self._js = js
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self._config = ConsumerConfig(
            durable_name=durable,
            deliver_policy=deliver_policy,
            opt_start_seq=opt_start_seq,
            ack_policy=AckPolicy.ALL if ack_all else AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_ack_pending=max_ack_pending,
            filter_subject=filter_subject,
            # A file-stored consumer's nats-server rewrites a file (new file, rename) after
            # nearly every delivery and ack, CPU taken from a runner on the same machine
            # (docs/architecture.md). In memory, its position is lost with a restart of the
            # server.
            mem_storage=memory or None,
        )
        self._ack_all = ack_all
        self._memory = memory
        self._reconnects = 0  # the connection's reconnects when the position was last checked
        self._puller: Puller | None = None
        self.stats = ConsumerStats()
        # Highest stream sequence fetched, dead letters included: how far this consumer got.
        self.last_stream_seq = 0
        # The stream sequences of the last fetch, dead letters included, as delivered.
        self.fetched_seqs: list[int] = []
        # Their subjects (which name the event type, even of a malformed event).
        self.fetched_subjects: dict[int, str] = {}
        # The digest of the message at last_stream_seq (bus/log_position.py), what a reader
        # keeps with its position.
        self.last_digest = ""
        # The last message fetched, dead letters included: what ``ack_fetched`` acks.
        self._last_fetched: Msg | None = None

    async def start(self, *, recreate: bool = False) -> None:
        """Bind to the durable consumer, creating it if needed. ``recreate`` drops an existing
        one first, so that its start position is the one given here."""
        if recreate:
            with contextlib.suppress(NotFoundError):
                await self._js.delete_consumer(self.stream, self.durable)
        try:
            info = await self._js.consumer_info(self.stream, self.durable)
            if info.config.filter_subject != self.filter_subject:
                # Same name, different selection: the old consumer would deliver the wrong
                # messages, so replace it.
                await self._js.delete_consumer(self.stream, self.durable)
                await self._js.add_consumer(self.stream, self._config)
        except NotFoundError:
            await self._js.add_consumer(self.stream, self._config)
        await self._rewind_if_past_end()
        self._puller = Puller(self._js, self.stream, self.durable)
        await self._puller.start()

    async def _rewind_if_past_end(self) -> None:
        """A stored consumer whose position is past the stream's end (the stream lost its
        unsynced tail in a power cut, the consumer's state did not) re-reads from the stream's
        end: made again there, it gets every event stored from now on. Checked at start and
        after every reconnect to the server (nats-server 2.14 and later do the same at their
        own start). A consumer in memory is made again by its owner after a restart anyway."""
        reconnects = self._js._nc.stats["reconnects"]  # the client has no public accessor
        if self._memory:
            self._reconnects = reconnects
            return
        info = await self._js.consumer_info(self.stream, self.durable)
        last = (await self._js.stream_info(self.stream)).state.last_seq
        delivered = info.delivered.stream_seq if info.delivered else 0
        acked = info.ack_floor.stream_seq if info.ack_floor else 0
        if not consumer_past_end(delivered or 0, acked or 0, last):
            self._reconnects = reconnects
            return
        log.critical(
            "consumer %s on %s stands at #%d, past the stream's end #%d (the log lost its"
            " tail): it re-reads from the stream's end",
            self.durable,
            self.stream,
            max(delivered or 0, acked or 0),
            last,
        )
        config = dataclasses.replace(
            self._config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=last + 1
        )
        with contextlib.suppress(NotFoundError):
            await self._js.delete_consumer(self.stream, self.durable)
        await self._js.add_consumer(self.stream, config)
        self._reconnects = reconnects

    async def stop(self) -> None:
        if self._puller is not None:
            await self._puller.stop()
            self._puller = None

    async def fetch(
        self,
        batch: int = 1,
        timeout: float = 1.0,
        *,
        more: bool = False,
        stop: asyncio.Event | None = None,
    ) -> list[Delivered]:
        """Up to ``batch`` parsed events; an empty list when none came within ``timeout`` (or
        ``stop`` was set meanwhile). Malformed messages are dead-lettered on the way and not
        returned. With ``more``: only the events there already, the rest of a batch whose
        first part the last fetch got (``fetched_seqs`` and ``fetched_subjects`` then hold both
        parts)."""
        if self._puller is None:
            raise RuntimeError("consumer not started")
        if self._js._nc.stats["reconnects"] != self._reconnects:
            try:
                await self._rewind_if_past_end()
            except NotFoundError:
                raise ConsumerGone(f"consumer {self.durable} on {self.stream} is gone") from None
            except (nats.errors.Error, TimeoutError) as exc:  # not answering yet: next fetch
                log.info("consumer %s: its position could not be checked: %r", self.durable, exc)
                await asyncio.sleep(NO_LEADER_PAUSE_S)
                return []
        pulling = asyncio.ensure_future(self._puller.fetch(batch, timeout, wait=not more))
        if stop is not None:
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({pulling, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
            if not pulling.done():
                pulling.cancel()  # the puller ends its pull request (nothing is lost)
                with contextlib.suppress(asyncio.CancelledError):
                    await pulling
                return []
        try:
            msgs = await pulling
        except NoResponders:
            if not await self._exists():
                raise ConsumerGone(f"consumer {self.durable} on {self.stream} is gone") from None
            await asyncio.sleep(NO_LEADER_PAUSE_S)  # a cluster electing a leader: not for long
            return []
        out: list[Delivered] = []
        if not more:
            self.fetched_seqs = []
            self.fetched_subjects = {}
            self._last_fetched = None
        if msgs:
            self._last_fetched = msgs[-1]
        newest: Msg | None = None
        for msg in msgs:
            seq = stream_seq(msg)
            self.fetched_seqs.append(seq)
            self.fetched_subjects[seq] = msg.subject
            if seq > self.last_stream_seq:
                self.last_stream_seq, newest = seq, msg
            try:
                event = parse_event(msg.data)
            except ValidationError as exc:
                await self.dead_letter(msg, describe_invalid(exc))
                continue
            out.append(Delivered(event, msg, seq))
        if newest is not None:  # one digest a fetch: only the last position is kept
            self.last_digest = digest(newest.data)
        self.stats.delivered += len(out)
        return out

    async def ack_fetched(self) -> None:
        """Acknowledge everything the last fetch got (an ``ack_all`` consumer's)."""
        assert self._ack_all, "only an ack_all consumer acks a fetch at once"
        if self._last_fetched is not None:
            await self._last_fetched.ack()
            self._last_fetched = None

    async def _exists(self) -> bool:
        """False only when the server says there is no such consumer; a server that cannot say
        (a cluster without a leader for it yet) is not taken for a no."""
        try:
            # Briefly: a cluster without a leader for it does not answer at all.
            await self._js.consumer_info(self.stream, self.durable, timeout=NO_LEADER_PAUSE_S)
        except NotFoundError:
            return False
        except (nats.errors.Error, TimeoutError):
            pass
        return True

    async def dead_letter(self, msg: Msg, reason: str) -> None:
        """Set ``msg`` aside: keep a copy with the reason, stop its redelivery, count it."""
        md = msg.metadata
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + "..."
        headers = {
            REASON_HEADER: _ascii(reason),
            SUBJECT_HEADER: _ascii(msg.subject),
            STREAM_HEADER: self.stream,
            SEQ_HEADER: str(md.sequence.stream),
            CONSUMER_HEADER: self.durable,
            # Redelivery of the original must not create a second dead letter.
            "Nats-Msg-Id": f"dead:{self.stream}:{md.sequence.stream}",
        }
        data = msg.data
        # A message near the server's limit does not fit in a dead letter with these headers,
        # and the server would close the connection over it: keep as much as fits.
        room = max_payload(self._js) - message_size(b"", headers | {SIZE_HEADER: str(len(data))})
        if len(data) > room:
            headers[SIZE_HEADER] = str(len(data))
            data = data[: max(room, 0)]
        await self._js.publish(deadletter_subject(self.stream), data, headers=headers)
        if not self._ack_all:  # an ack_all consumer's next ack covers it
            await msg.term()
        self.stats.dead_letters += 1
        key = reason.split(":", 1)[0]
        self.stats.dead_letter_reasons[key] = self.stats.dead_letter_reasons.get(key, 0) + 1
        log.warning(
            "dead-lettered %s seq %d on %s: %s",
            self.stream,
            md.sequence.stream,
            self.durable,
            reason,
        )

    async def run(
        self,
        handle: Callable[[Event], Awaitable[None]],
        *,
        stop_after: int | None = None,
        max_attempts: int = 3,
    ) -> None:
        """Handle events one at a time, acking each after ``handle`` returns. An exception in
        ``handle`` has the event redelivered a little later, and dead-lettered once it has failed
        ``max_attempts`` times, so one poisonous event never stops the consumer. Cancel to stop."""
        handled = 0
        while stop_after is None or handled < stop_after:
            for d in await self.fetch(1, timeout=5.0):
                try:
                    await handle(d.event)
                except Exception as exc:  # a bad event must not stop the consumer
                    log.exception("handler failed on %s", d.msg.subject)
                    if d.msg.metadata.num_delivered >= max_attempts:
                        await self.dead_letter(d.msg, f"handler error: {exc!r}")
                    else:
                        await d.msg.nak(delay=1.0)
                    continue
                await d.ack()
                handled += 1
