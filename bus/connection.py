"""Connecting to NATS with the options every Shoal process uses."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


async def connect(url: str = DEFAULT_NATS_URL, name: str = "shoal") -> Client:
    """Connect, retrying for a while on start-up, and keep reconnecting forever afterwards."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    return await nats.connect(
        servers=[u.strip() for u in url.split(",")],
        name=name,
        connect_timeout=5,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        error_cb=on_error,
    )
