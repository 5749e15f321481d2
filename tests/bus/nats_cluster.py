"""What the tests of a NATS cluster (``harness/clusters.py``) do to it: read a stream's info
while it elects a leader, move a stream's or a consumer's leadership to a server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.js.api import StreamInfo
from nats.js.errors import Error as JetStreamError


async def stream_info(nc: Client, stream: str, timeout: float = 30.0) -> StreamInfo:
    """The stream's info, asking again while it has no leader to answer (after its leader's
    server was lost, for a few seconds)."""
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(nats.errors.Error, JetStreamError):
                return await nc.jetstream(timeout=1.0).stream_info(stream)
            await asyncio.sleep(0.1)


async def make_leader(nc: Client, stream: str, server_name: str, timeout: float = 30.0) -> None:
    """Move the leadership of ``stream`` to ``server_name`` (a replica that is up to date).
    Asked again only once the election the last request started has ended: a step-down asked
    while one is under way starts another, and on a loaded machine that never ends."""

    async def leader() -> str | None:
        info = await stream_info(nc, stream)
        return info.cluster.leader if info.cluster is not None else None

    subject = f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}"
    await _move_leader(nc, leader, subject, server_name, timeout)


async def _move_leader(
    nc: Client,
    leader: Callable[[], Awaitable[str | None]],
    subject: str,
    server_name: str,
    timeout: float,
) -> None:
    request = json.dumps({"placement": {"preferred": server_name}}).encode()
    async with asyncio.timeout(timeout):
        while (old := await leader()) != server_name:
            if old is None:  # an election is under way
                await asyncio.sleep(0.2)
                continue
            with contextlib.suppress(nats.errors.Error, JetStreamError):
                await nc.request(subject, request, timeout=1.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10.0):
                    while await leader() in (old, None):
                        await asyncio.sleep(0.2)


async def make_consumer_leader(
    nc: Client, stream: str, consumer: str, server_name: str, timeout: float = 30.0
) -> None:
    """Move the leadership of a durable consumer (replicated like its stream) to
    ``server_name``."""

    async def leader() -> str | None:
        while True:
            with contextlib.suppress(nats.errors.Error, JetStreamError):
                info = await nc.jetstream(timeout=1.0).consumer_info(stream, consumer)
                return info.cluster.leader if info.cluster is not None else None
            await asyncio.sleep(0.1)

    subject = f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}"
    await _move_leader(nc, leader, subject, server_name, timeout)
