"""Prompt parts stored once, by digest: the claim-check pattern.

A request's messages and tool definitions do not ride inside ``TaskCreated``: they are stored
on the ``SHOAL_PARTS`` stream, one JetStream message per part on ``shoal.parts.<sha256>``, and
the event names them with a ``PartRef`` (digest, how many parts, how many bytes), which
``nats sub`` shows as it shows the rest of the event.

The parts of a list (a conversation's messages, a response's input items) form a chain: each
holds one value and the digest of the part before it, so a list is named by its last part, and
the next turn of a conversation, which repeats every earlier message, stores only its new ones.
The stream keeps one message per subject: a part stored again replaces itself, so storing is
idempotent and the stream's bytes are each distinct part's once.

Parts age out with the events that name them: the stream keeps a part for half again the
events' age limit, and a process that names a part it stored more than half that limit ago
stores it again (which renews it), so no kept event names a part that is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from bus.leaderless import RETRY_FOR_S, ask_again
from bus.payload import PayloadTooLargeError, max_payload, message_size
from events.records import PartRef
from events.subjects import PARTS_PREFIX

PARTS_STREAM = "SHOAL_PARTS"
# How many parts are stored at once (each waits for its ack).
IN_FLIGHT = 64
# Parts read back, kept by a process for the next turn of their conversation (their bytes).
CACHE_BYTES = 16 * 1024 * 1024
# How often the events' age limit is read again (an operator may change it).
RENEWAL_READ_S = 600.0
# What one kept part costs besides its bytes (its digest, the bytes' header, the dict's entry).
ENTRY_BYTES = 256
# Digests a process stored, and when (so that it stores them again only when they age): about
# 230 bytes each. Forgetting one costs at most a part stored again, which replaces itself.
KNOWN_MAX = 10_000


class PartTooLarge(PayloadTooLargeError):
    """A value of a chain too large for one NATS message: ``index`` says which."""

    def __init__(self, index: int, size: int, limit: int) -> None:
        super().__init__(f"value {index}", size, limit)
        self.index = index


class PartMissing(LookupError):
    """A part an event names is not on the stream (aged out, or the stream was lost), or its
    bytes are not those of its digest."""


def parts_config(max_age: float, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=PARTS_STREAM,
        subjects=[f"{PARTS_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.OLD,
        max_age=max_age,
        num_replicas=replicas,
        allow_direct=True,
    )


def parts_max_age(events_max_age: float) -> float:
    """How long parts are kept: half again the events' age limit (0: forever, as events)."""
    return events_max_age * 1.5


def part_subject(digest: str) -> str:
    return f"{PARTS_PREFIX}.{digest}"


def _encode(value: Any) -> bytes:
    # Keys in the order they came: a tool's schema, as a chat template renders it and as its
    # grammar orders the arguments, is the client's (sorted, the model saw another prompt).
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Part:
    """One link of a chain: its value and the digest of the part before it (None: the first)."""

    digest: str
    parent: str | None
    value: Any
    body: bytes


def chain(values: Sequence[Any]) -> list[Part]:
    """``values`` as the parts of a chain, in order (pure)."""
    parts: list[Part] = []
    parent: str | None = None
    for value in values:
        body = _encode({"parent": parent, "value": value})
        digest = hashlib.sha256(body).hexdigest()
        parts.append(Part(digest, parent, value, body))
        parent = digest
    return parts


def ref_of(parts: Sequence[Part]) -> PartRef | None:
    if not parts:
        return None
    return PartRef(digest=parts[-1].digest, parts=len(parts), bytes=sum(len(p.body) for p in parts))


def oversized(parts: Sequence[Part], limit: int) -> PartTooLarge | None:
    """The first part larger than a NATS message may be (``limit``), or None."""
    for i, p in enumerate(parts):
        if (size := message_size(p.body)) > limit:
            return PartTooLarge(i, size, limit)
    return None


def read_part(digest: str, body: bytes) -> Part:
    """A part from its stored bytes, checked against its digest."""
    if hashlib.sha256(body).hexdigest() != digest:
        raise PartMissing(f"part {digest} is damaged: its bytes are not those of its digest")
    return _decoded(digest, body)


def _decoded(digest: str, body: bytes) -> Part:
    decoded = json.loads(body)
    return Part(digest, decoded["parent"], decoded["value"], body)


class PartStore:
    """Stores and reads chains of parts for one process. It remembers which parts it stored and
    when (so a conversation's next turn stores only its new messages), and keeps the bytes of
    the parts it read within ``cache_bytes``, least recently read out first (so a runner reads
    only a turn's new messages). A chain's last part is not kept when read: a one-turn request
    (most are) is never read again, and a conversation that goes on reads its last part once
    more, as an earlier one, and keeps it then. So one-turn requests leave the cache alone."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        renewal: Callable[[], Awaitable[float]] | None = None,
        cache_bytes: int = CACHE_BYTES,
        known_max: int = KNOWN_MAX,
        retry_for: float = RETRY_FOR_S,
    ) -> None:
        """``renewal``: after how long a part stored is stored again when named (``renewal`` in
        bus/streams.py: half the events' age limit; 0: never, they are kept forever), asked
        again every RENEWAL_READ_S. None: never (a process that only reads). ``retry_for``:
        how long a part is published again while JetStream does not store it. ``known_max``:
        how many digests stored are remembered at most (the most recently stored)."""
        self._js = js
        self._retry_for = retry_for
        self._renewal = renewal
        self._renew_after_s = 0.0
        self._renewal_read_at: float | None = None
        self._stored: OrderedDict[str, float] = OrderedDict()
        self._known_max = known_max
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._cached = 0
        self._in_flight = asyncio.Semaphore(IN_FLIGHT)

    @property
    def limit(self) -> int:
        """The largest part the connected server takes."""
        return max_payload(self._js)

    async def put(self, values: Sequence[Any]) -> PartRef | None:
        """Store ``values`` as a chain and name it. Raises PartTooLarge for a value too large
        for one NATS message."""
        parts = chain(values)
        if (too_large := oversized(parts, self.limit)) is not None:
            raise too_large
        await self.store(parts)
        return ref_of(parts)

    async def store(self, parts: Sequence[Part]) -> None:
        """Store the parts not stored already (or stored so long ago they must be renewed)."""
        now = time.monotonic()
        renew = await self._renew_after(now)
        new = [
            p
            for p in parts
            if (at := self._stored.get(p.digest)) is None or (renew and now - at > renew)
        ]
        await asyncio.gather(*(self._publish(p) for p in new))
        for p in new:
            self._remember(p.digest, now)
        self._forget_aged(now, renew)

    async def get(self, ref: PartRef, *, keep: bool = True) -> list[Any]:
        """The values of the chain ``ref`` names, in order. ``keep``: the parts read are kept
        for the next turn (an image's are not: they would push a conversation's out)."""
        values: list[Any] = []
        digest: str | None = ref.digest
        while digest is not None:
            part = await self._part(digest, keep=keep and digest != ref.digest)
            values.append(part.value)
            digest = part.parent
            if len(values) > ref.parts:
                raise PartMissing(f"the chain of {ref.digest} is longer than its {ref.parts} parts")
        if len(values) != ref.parts:
            raise PartMissing(f"the chain of {ref.digest} has {len(values)} of {ref.parts} parts")
        values.reverse()
        return values

    async def _publish(self, part: Part) -> None:
        async with self._in_flight:
            await ask_again(
                lambda: self._js.publish(part_subject(part.digest), part.body, timeout=5.0),
                within_s=self._retry_for,
                pause_s=0.05,
                max_pause_s=1.0,
                what=f"storing part {part.digest}",
            )

    async def _part(self, digest: str, keep: bool) -> Part:
        if (cached := self._cache.get(digest)) is not None:
            self._cache.move_to_end(digest)
            return _decoded(digest, cached)
        try:
            msg = await ask_again(
                lambda: self._js.get_last_msg(PARTS_STREAM, part_subject(digest), direct=True)
            )
        except NotFoundError:
            raise PartMissing(f"part {digest} is not stored (aged out, or never stored)") from None
        part = read_part(digest, msg.data or b"")
        if keep:
            self._cache[digest] = part.body
            self._cached += len(part.body) + ENTRY_BYTES
            while self._cached > self._cache_bytes and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cached -= len(old) + ENTRY_BYTES
        return part

    @property
    def cached_bytes(self) -> int:
        """The memory the parts kept for the next turn take (about)."""
        return self._cached

    def _remember(self, digest: str, at: float) -> None:
        self._stored[digest] = at
        self._stored.move_to_end(digest)
        while len(self._stored) > self._known_max:
            self._stored.popitem(last=False)

    def _forget_aged(self, now: float, renew: float) -> None:
        """Digests stored longer ago than ``renew`` would be stored again anyway: remembering
        them spares nothing (oldest first: the dict is in the order they were stored)."""
        if not renew:
            return
        while self._stored and now - next(iter(self._stored.values())) > renew:
            self._stored.popitem(last=False)

    @property
    def known(self) -> int:
        """How many digests this process remembers storing."""
        return len(self._stored)

    async def _renew_after(self, now: float) -> float:
        if self._renewal is not None and (
            self._renewal_read_at is None or now - self._renewal_read_at > RENEWAL_READ_S
        ):
            self._renew_after_s = await self._renewal()
            self._renewal_read_at = now
        return self._renew_after_s
