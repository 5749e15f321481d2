"""Connecting to NATS with the options every Shoal process uses."""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.aio.client import Client

log = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class NatsUnavailable(ConnectionError):
    pass


async def connect(
    url: str = DEFAULT_NATS_URL, name: str = "shoal", startup_timeout: float = 10.0
) -> Client:
    """Connect; once connected, keep reconnecting forever. A server that cannot be reached
    within ``startup_timeout`` is a clear error, not a hang."""
    nc = Client()
    connected = False

    async def on_error(exc: Exception) -> None:
        # Before the first connection every retry fails the same way: say it once, at the end.
        if connected:
            log.warning("nats: %s", exc)

    try:
        await asyncio.wait_for(
            nc.connect(
                servers=[u.strip() for u in url.split(",")],
                name=name,
                connect_timeout=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=1,
                error_cb=on_error,
            ),
            startup_timeout,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        await nc.close()
        reason = str(exc) or f"no answer within {startup_timeout:g}s"
        raise NatsUnavailable(f"cannot reach NATS at {url}: {reason}") from exc
    connected = True
    return nc
