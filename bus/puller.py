"""The JetStream pull protocol, spoken directly over one inbox."""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext


class ConsumerGone(nats.errors.Error):
    """The consumer pulled from does not exist (any more): deleted, or kept in memory by a
    nats-server that restarted. Whoever made it decides how to make it again."""


class NoResponders(nats.errors.Error):
    """Nobody answered the pull (503): there is no such consumer, or, in a cluster, it has no
    leader for the moment."""


class Puller:
    """The JetStream pull protocol on one inbox.

    nats-py's ``PullSubscription.fetch`` waits on each message with its own timer, which caps a
    consumer's rate (docs/architecture.md); this collects a whole batch in one callback-driven
    wait. A fetch first asks with ``no_wait`` for what is already there; only
    when that is nothing does it wait, for a single message, so that an idle consumer never has
    messages delivered to it that it has not asked for (a busy runner pulls nothing).
    """

    def __init__(self, js: JetStreamContext, stream: str, consumer: str) -> None:
        self._nc = js._nc  # the context has no public accessor for its client
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = ""
        self._sub: Subscription | None = None
        self._received: list[Msg] = []
        self._wanted = 0
        self._done = asyncio.Event()
        self._failure: nats.errors.Error | None = None

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)

    async def stop(self) -> None:
        """Stop pulling. Dropping the inbox ends any open pull request on the server; anything
        delivered but not yet fetched goes back to the consumer for another replica."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        left, self._received = self._received, []
        for msg in left:
            await msg.nak()

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if not status:
            self._received.append(msg)
            if len(self._received) >= self._wanted:
                self._done.set()
        elif status != "100":  # 404 no messages, 408 expired, 409 ...: this request is over
            description = str(msg.headers.get("Description", "")) if msg.headers else ""
            if status == "503":
                self._failure = NoResponders(f"nobody answers on {self._next_subject}")
            elif status == "409" and "deleted" in description.lower():
                self._failure = ConsumerGone(f"{self._next_subject}: {description}")
            self._done.set()

    async def _request(self, batch: int, *, no_wait: bool, expires: float) -> list[Msg]:
        self._wanted = len(self._received) + batch
        self._done.clear()
        self._failure = None
        req: dict[str, object] = {"batch": batch}
        if no_wait:
            req["no_wait"] = True
        else:
            req["expires"] = int(expires * 1e9)
        await self._nc.publish(self._next_subject, json.dumps(req).encode(), reply=self._inbox)
        try:
            # If the server's status reply is lost (e.g. a reconnect), return what came.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), timeout=expires + 2.0)
        except asyncio.CancelledError:
            # A cancelled fetch must not leave a pull request open that would take a message
            # nobody will handle: drop the inbox (the server then ends the request).
            await self.stop()
            await self.start()
            raise
        msgs, self._received = self._received, []
        if self._failure is not None and not msgs:
            raise self._failure
        return msgs

    async def fetch(self, batch: int, timeout: float, *, wait: bool = True) -> list[Msg]:
        """Up to ``batch`` messages; without ``wait``, only those there already. Raises
        ``ConsumerGone`` when the consumer was deleted, ``NoResponders`` when nobody answers."""
        msgs = await self._request(batch, no_wait=True, expires=timeout)
        if msgs or not wait:
            return msgs
        return await self._request(1, no_wait=False, expires=timeout)
