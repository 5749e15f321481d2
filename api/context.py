"""What an API process holds: its connections, counters and recent answers (no state of its
own: all state is on the log)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.routing import APIRoute
from nats.aio.client import Client
from nats.js import JetStreamContext
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from api import admission, keys, projection, roles
from api.admission import Admission
from api.config import ApiConfig
from api.errors import ApiError
from api.keys import KeyBook, Principal, given_key, principal_or_refusal
from api.metrics import ApiMetrics
from api.model_names import ModelNames, NamesCache, names_from
from api.rate_limit import RateLimits
from api.serving_verdicts import ServingVerdicts
from bus.publisher import Publisher
from bus.stores.parts import PartStore
from bus.streams import renewal
from events.catalogue import EventBase
from events.kinds import InstanceRole
from projectors.state import ClusterState


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
    # A request's messages and tools, stored once by digest (bus/stores/parts.py).
    parts: PartStore = field(init=False)
    # Each key's requests and tokens of the last minute (api/rate_limit.py).
    rate_limits: RateLimits = field(default_factory=RateLimits)
    # The keys made with `shoal keys add`, as last read (api/keys.py).
    key_book: KeyBook = field(default_factory=KeyBook)

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    def __post_init__(self) -> None:
        js = self.nc.jetstream()
        self.parts = PartStore(js, renewal=lambda: renewal(js), retry_for=self.config.log_wait_s)

    async def model_names(self) -> ModelNames:
        """The names clients call models by, read again at most once a second."""
        names = self.names.fresh()
        if names is None:
            names = self.names_in(await projection.cluster(self.engine))
        return names

    def names_in(self, state: ClusterState) -> ModelNames:
        """The names of ``state``, kept as the freshest (``state`` was read after the cache
        was)."""
        names = names_from(state, self.config.aliases, self.config.default_model)
        self.names.keep(names)
        return names

    async def resolve_model(self, name: str | None, role: InstanceRole = "chat") -> str:
        """The model id a request's ``model`` means (see ``ModelNames.resolve``)."""
        if name and self.serving.fresh(name, role):
            return name  # an id that was just served: no read on the path of most requests
        return (await self.model_names()).resolve(name, role)

    async def publish(self, event: EventBase, msg_id: str | None = None) -> None:
        """Store ``event`` on the log (counted in the metrics); ``msg_id``: its message id,
        when every API process must store one event for one thing (else the event's id)."""
        js = self.nc.jetstream()
        await Publisher(js, retry_for=self.config.log_wait_s).publish(event, msg_id=msg_id)
        self.metrics.event_published(event)


# The dependencies are coroutines although they never wait: FastAPI runs a plain function in a
# worker thread, two thread hops on every request, paid out of its time to first token.


async def context(request: Request) -> ApiContext:
    return _context(request)


def _context(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


async def require_key(request: Request) -> None:
    """Every route but the public ones needs a key whose role allows it (``api/roles.py``):
    who the request is was found by the guard at the edge (``api/limits.py``), before its
    body was read (a 401 there); a key whose role does not reach the route gets a 403 here."""
    route = request.scope.get("route")
    path = route.path if isinstance(route, APIRoute) else request.url.path
    role = roles.needed(request.method, path)
    if role == "public":
        return
    ctx = _context(request)
    given = given_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
    who = request.scope.get("state", {}).get("principal")
    if not isinstance(who, Principal):  # an app without the guard (it is always installed)
        made = await ctx.key_book.keys(ctx.engine, ctx.js)
        found = principal_or_refusal(given, ctx.config.api_keys, made, ctx.key_book.ever_made)
        if isinstance(found, ApiError):
            raise found
        who = found
    if not roles.allows(who.role, role):
        raise ApiError(
            403,
            f"The key {who.name!r} is a {who.role} key: {request.method} {path} needs an"
            f" {role} key",
            code="permission_denied",
        )
    keys.PRINCIPAL.set(who)
    # For admission's fairness between keys, and to hear a queued request's client leave.
    admission.note_caller(who.key_id or given, request.receive)
