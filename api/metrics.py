"""Prometheus metrics at ``GET /metrics`` (served by ``api/cluster/metrics_routes.py``).

Two kinds, in one scrape:

- what this API process served: HTTP requests by route, tokens, time to first token, tokens/s,
  events it published. Counted in memory, in a registry of its own (not prometheus_client's
  global one), so each app counts alone; several API processes are several scrape targets;
- the cluster as the log and the projection show it at scrape time: events by type (counted by
  the projector as it applies them, and those past its tracking row), durable consumers'
  backlog, projector lag, dead letters, runners by state, node memory. Read afresh on every
  scrape, so every API process reports the same values; a scrape only reads, from the
  database and from the nats-server (it creates no consumer there): api/cluster_metrics.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from nats.js import JetStreamContext
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.cluster_metrics import cluster_families, gauge, read_log, read_projection
from events.catalogue import EventBase

if TYPE_CHECKING:
    from api.admission import ModelAdmission
    from api.task_stream import TaskStream

log = logging.getLogger(__name__)

# No ``<name>_created`` series beside each counter and histogram: in the classic text format
# they are extra gauges that double the series. (A process-wide switch: an API process is the
# only user of prometheus_client in it.)
disable_created_metrics()  # type: ignore[no-untyped-call]

# The classic text format (what prometheus_client's generate_latest writes); spelled out
# because newer prometheus_client versions call 1.0.0 "latest".
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

OTHER = "other"  # the endpoint of a path no route serves, the method of an unusual verb
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})

# From a few milliseconds (a warm small model on a GPU) to tens of seconds (a queued request
# or a long prompt on CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
# From admitted at once to waiting as long as the API waits for a task (600 s by default).
QUEUE_WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Each source of cluster-wide values gets this long per scrape; one that does not answer is
# left out (shoal_metrics_source_up says so) rather than holding up the scrape. Two in turn
# stay within Prometheus's default scrape timeout of 10 s.
READ_TIMEOUT_S = 4.0


# --- what this process serves ---------------------------------------------------------------


class ApiMetrics:
    """The counters and histograms of one API process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "shoal_http_requests",
            "HTTP requests answered, by route.",
            ["method", "endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "shoal_http_request_errors",
            "HTTP requests answered with a 4xx or 5xx status, by route.",
            ["method", "endpoint", "status"],
            registry=r,
        )
        self.refusals = Counter(
            "shoal_http_requests_refused",
            "HTTP requests answered with an error, by route, status and reason (the error's"
            " code); each is also a log line with the key's name (api/refusals.py).",
            ["endpoint", "status", "reason"],
            registry=r,
        )
        self.tokens = Counter(
            "shoal_tokens_generated",
            "Completion tokens of the tasks this API served to the end.",
            ["model"],
            registry=r,
        )
        self.ttft = Histogram(
            "shoal_time_to_first_token_seconds",
            "From publishing a task to its first token reaching this API.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tokens_per_s = Histogram(
            "shoal_tokens_per_second",
            "Tokens per second after the first, as they reached this API, per task.",
            ["model"],
            buckets=TOKENS_PER_S_BUCKETS,
            registry=r,
        )
        self.published = Counter(
            "shoal_events_published", "Events this API process published.", ["type"], registry=r
        )
        self.queue_wait = Histogram(
            "shoal_admission_wait_seconds",
            "How long admitted requests waited in this API's queue for a slot of their model.",
            ["model"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        ProcessCollector(registry=r)
        GCCollector(registry=r)

    def request(self, method: str, endpoint: str, status: int) -> None:
        labels = (method if method in METHODS else OTHER, endpoint, str(status))
        self.requests.labels(*labels).inc()
        if status >= 400:
            self.errors.labels(*labels).inc()

    def refused(self, endpoint: str, status: int, reason: str) -> None:
        self.refusals.labels(endpoint, str(status), reason).inc()

    def queue_waited(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)

    def event_published(self, event: EventBase) -> None:
        self.published.labels(getattr(event, "type", type(event).__name__)).inc()

    def task_served(self, ts: TaskStream) -> None:
        """Record a task that completed (failed, abandoned or timed-out ones generated nothing
        the client got in full)."""
        done = ts.finished.completed if ts.finished is not None else None
        if done is None:
            return
        model = ts.task.model_id
        tokens = done.usage.completion_tokens
        self.tokens.labels(model).inc(tokens)
        ttft, rate = token_timing(tokens, ts.started_at, ts.first_chunk_at, ts.last_chunk_at)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if rate is not None:
            self.tokens_per_s.labels(model).observe(rate)


def token_timing(
    tokens: int, started: float | None, first: float | None, last: float | None
) -> tuple[float | None, float | None]:
    """(time to first token, tokens per second after the first), each None when the task
    gives nothing to measure: no token, or a single one for the rate."""
    if tokens < 1 or started is None or first is None:
        return None, None
    ttft = first - started
    if tokens < 2 or last is None or last <= first:
        return ttft, None
    return ttft, (tokens - 1) / (last - first)


def admission_families(models: Sequence[ModelAdmission]) -> list[Metric]:
    """This process's admission control, per model, as it stands (api/admission.py)."""
    gauges = {
        "capacity": gauge(
            "shoal_admission_capacity",
            "Tasks of the model this API lets be in flight at once: its serving runners' slots.",
            ["model"],
        ),
        "in_flight": gauge(
            "shoal_admission_in_flight",
            "Tasks this API published that have not ended yet.",
            ["model"],
        ),
        "queued": gauge(
            "shoal_admission_queued", "Requests waiting in this API for a slot.", ["model"]
        ),
        "max_queued": gauge(
            "shoal_admission_max_queued", "How many requests may wait; past it, a 429.", ["model"]
        ),
        "oldest_wait_s": gauge(
            "shoal_admission_oldest_wait_seconds",
            "How long the request queued longest has waited (0: none waits).",
            ["model"],
        ),
    }
    rejected = CounterMetricFamily(
        "shoal_admission_rejected",
        "Requests refused with a 429: the model's queue in this API was full.",
        labels=["model"],
    )
    for m in models:
        for name, family in gauges.items():
            family.add_metric([m.model], float(getattr(m, name)))
        rejected.add_metric([m.model], m.rejected)
    return [*gauges.values(), rejected]


def endpoint_of(scope: Scope, root_path_before: str) -> str:
    """The template of the route that served a request (``/v1/instances/{instance_id}``), read
    from the scope after routing: raw paths would give every instance id its own time series.
    FastAPI puts the route it chose in the scope (also for a 405); a mounted app (the static
    files) shows as the prefix routing added to ``root_path``; anything else is ``other``."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if isinstance(template, str) and template:
        return template
    root_path = str(scope.get("root_path", ""))
    if root_path != root_path_before and root_path.startswith(root_path_before):
        return f"{root_path[len(root_path_before) :]}/{{path}}"
    return OTHER


# The status counted for a request whose client left before its response started.
CLIENT_GONE = 499


class HttpMetrics:
    """ASGI middleware counting each HTTP request by method, route and status. It passes every
    message on as it comes, so streamed responses (server-sent events) are never buffered."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        root_path = str(scope.get("root_path", ""))
        status: int | None = None
        gone = False

        async def receive_noted() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive_noted, send_counted)
        finally:
            if status is None:
                # No response started: the client went away first (nginx's 499, not the
                # server's fault), or an exception that becomes a 500 outside.
                status = CLIENT_GONE if gone else 500
            self.metrics.request(scope["method"], endpoint_of(scope, root_path), status)


T = TypeVar("T")


async def _read_or_none(what: str, reading: Awaitable[T]) -> T | None:
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            return await reading
    except Exception as exc:  # a scrape reports what it could read
        log.warning("metrics: could not read the %s: %s", what, exc)
        return None


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


async def exposition(
    metrics: ApiMetrics,
    admission: Sequence[ModelAdmission],
    engine: AsyncEngine,
    js: JetStreamContext,
    projector: str,
) -> bytes:
    """The text of one scrape: this process's metrics (``metrics``, ``admission``), then the
    cluster's, read now. The projection first: read the other way round, events published in
    between could be applied by then and show as a negative lag."""
    projection = await _read_or_none("projection", read_projection(engine, projector))
    applied = projection.applied_seq.get(projector) if projection else None
    events = await _read_or_none("event log", read_log(js, applied))
    cluster = _Families(cluster_families(events, projection, projector))
    admitting = _Families(admission_families(admission))
    return generate_latest(metrics.registry) + generate_latest(admitting) + generate_latest(cluster)
