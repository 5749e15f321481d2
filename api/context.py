"""What an API process holds: its connections, counters and recent answers (no state of its
own: all state is on the log)."""

from __future__ import annotations

import hmac
import socket
from dataclasses import dataclass, field

from fastapi import Request
from nats.aio.client import Client
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from api import admission, projection
from api.admission import Admission
from api.config import ApiConfig
from api.errors import ApiError
from api.metrics import ApiMetrics
from api.model_names import ModelNames, NamesCache, names_from
from api.serving_verdicts import ServingVerdicts
from bus.events import EventBase
from bus.kinds import InstanceRole
from bus.parts import PartStore
from bus.publisher import Publisher
from bus.streams import renewal


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
    # The names clients call models by, as last read (api/model_names.py).
    names: NamesCache = field(default_factory=lambda: NamesCache(1.0))
    # How many of each model's tasks this process lets run at once, and who waits (the queue).
    admission: Admission = field(default_factory=Admission)
    # A request's messages and tools, stored once by digest (bus/parts.py).
    parts: PartStore = field(init=False)

    def __post_init__(self) -> None:
        js = self.nc.jetstream()
        self.parts = PartStore(js, renewal=lambda: renewal(js))

    async def model_names(self) -> ModelNames:
        """The names clients call models by, read again at most once a second."""
        names = self.names.fresh()
        if names is None:
            state = await projection.cluster(self.engine)
            names = names_from(state, self.config.aliases, self.config.default_model)
            self.names.keep(names)
        return names

    async def resolve_model(self, name: str | None, role: InstanceRole = "chat") -> str:
        """The model id a request's ``model`` means (see ``ModelNames.resolve``)."""
        if name and self.serving.fresh(name, role):
            return name  # an id that was just served: no read on the path of most requests
        return (await self.model_names()).resolve(name, role)

    async def publish(self, event: EventBase) -> None:
        """Store ``event`` on the log (counted in the metrics)."""
        await Publisher(self.nc.jetstream()).publish(event)
        self.metrics.event_published(event)


# The dependencies are coroutines although they never wait: FastAPI runs a plain function in a
# worker thread, two thread hops on every request, paid out of its time to first token.


async def context(request: Request) -> ApiContext:
    return _context(request)


def _context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def require_key(request: Request) -> None:
    """With API keys configured, every endpoint but the health checks needs a key, as
    ``Authorization: Bearer`` (OpenAI's and Ollama's clients) or ``x-api-key`` (Anthropic's).
    The key given is never echoed back or logged."""
    headers = request.headers
    authorization, x_api_key = headers.get("authorization"), headers.get("x-api-key")
    refused = key_refusal(_context(request).config.api_keys, authorization, x_api_key)
    if refused is not None:
        raise refused
    # For admission's fairness between keys, and to hear a queued request's client leave.
    admission.note_caller(given_key(authorization, x_api_key), request.receive)


def given_key(authorization: str | None, x_api_key: str | None = None) -> str:
    """The key a request sent: its ``Authorization: Bearer`` value, else ``x-api-key``."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        given = x_api_key or ""
    return given.strip()


def key_refusal(
    keys: frozenset[str], authorization: str | None, x_api_key: str | None = None
) -> ApiError | None:
    """The 401 for a request with these headers, or None when it may pass."""
    if not keys:
        return None
    given = given_key(authorization, x_api_key)
    if not given:
        return ApiError(
            401,
            "You didn't provide an API key: send `Authorization: Bearer <key>`"
            " (or `x-api-key: <key>`)",
            code="invalid_api_key",
        )
    if not any(hmac.compare_digest(given, k) for k in keys):
        return ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    return None
