"""What an API process holds: its connections, counters and recent answers (no state of its
own: all state is on the log)."""

from __future__ import annotations

import hmac
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from nats.aio.client import Client
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from api.config import ApiConfig
from api.errors import ApiError
from api.serving_verdicts import ServingVerdicts
from bus.events import EventBase
from bus.publisher import Publisher

if TYPE_CHECKING:
    from api.metrics import ApiMetrics


@dataclass
class ApiContext:
    config: ApiConfig
    nc: Client
    engine: AsyncEngine
    metrics: ApiMetrics  # this process's counters (not state: they start at zero)
    # The recent answers of the check every request makes (what the database said, for a second).
    serving: ServingVerdicts
    origin: str = f"api@{socket.gethostname()}"
    # The same SQLite database, for the check every request makes (projection.serving).
    reader: Engine | None = None

    async def publish(self, event: EventBase) -> None:
        """Store ``event`` on the log (counted in the metrics)."""
        await Publisher(self.nc.jetstream()).publish(event)
        self.metrics.event_published(event)


# The dependencies are coroutines although they never wait: FastAPI runs a plain function in a
# worker thread, two thread hops on every request (~1 ms of its time to first token).


async def context(request: Request) -> ApiContext:
    return _context(request)


def _context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def require_key(request: Request) -> None:
    """With API keys configured, every endpoint but /healthz needs ``Authorization: Bearer``.
    The key given is never echoed back or logged."""
    refused = key_refusal(_context(request).config.api_keys, request.headers.get("authorization"))
    if refused is not None:
        raise refused


def key_refusal(keys: frozenset[str], authorization: str | None) -> ApiError | None:
    """The 401 for a request with this ``Authorization`` header, or None when it may pass."""
    if not keys:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ApiError(401, "You didn't provide an API key: send `Authorization: Bearer <key>`",
                        code="invalid_api_key")  # fmt: skip
    if not any(hmac.compare_digest(given.strip(), k) for k in keys):
        return ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    return None
