"""Prometheus metrics at ``GET /metrics`` (served by ``api/cluster/metrics_routes.py``).

Two kinds, in one scrape:

- what this API process served: HTTP requests by route, tokens, time to first token, tokens/s,
  events it published. Counted in memory, in a registry of its own (not prometheus_client's
  global one), so each app counts alone; several API processes are several scrape targets;
- the cluster as the log and the projection show it at scrape time: events by type (counted by
  the projector as it applies them, and those past its tracking row), durable consumers'
  backlog, projector lag, dead letters, runners by state, node memory. Read afresh on every
  scrape, so every API process reports the same values; a scrape only reads, from the
  database and from the nats-server (it creates no consumer there).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bus.streams import CHUNKS_STREAM, DEADLETTER_STREAM, EVENTS_STREAM
from events.catalogue import EventBase, LogTailLost, event_type_filters, subject_event_type
from events.states import NODE_STATUSES, RUNNER_STATES
from events.subjects import ALL_DEAD_LETTERS, dead_letter_origin
from projectors.projector import DEFAULT_NAME
from projectors.rows import DeviceRow, KeyRow, NodeRow, RunnerRow, UsageRow
from projectors.store import load_state, read_progress, task_resumes

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
# JetStream lists consumers in pages of this many.
CONSUMER_PAGE = 256
# Events past the projector's tracking row are read one by one (their subjects name their
# types) while there are at most this many; further behind, events by type in the log are left
# out of the scrape (the lag says how far behind it is).
UNAPPLIED_READ_MAX = 100

MEMORY_KINDS = ("total", "available", "offered")


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
        "capacity": _gauge(
            "shoal_admission_capacity",
            "Tasks of the model this API lets be in flight at once: its serving runners' slots.",
            ["model"],
        ),
        "in_flight": _gauge(
            "shoal_admission_in_flight",
            "Tasks this API published that have not ended yet.",
            ["model"],
        ),
        "queued": _gauge(
            "shoal_admission_queued", "Requests waiting in this API for a slot.", ["model"]
        ),
        "max_queued": _gauge(
            "shoal_admission_max_queued", "How many requests may wait; past it, a 429.", ["model"]
        ),
        "oldest_wait_s": _gauge(
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


# --- what the cluster holds, read at scrape time ------------------------------------------


def dead_letters_by_stream(subjects: Mapping[str, int]) -> dict[str, int]:
    """Counts per dead-letter subject (``shoal.deadletter.<stream>``) -> per original stream."""
    out: dict[str, int] = {}
    for subject, n in subjects.items():
        if (stream := dead_letter_origin(subject)) is not None:
            out[stream] = out.get(stream, 0) + n
    return out


@dataclass(frozen=True)
class ConsumerBacklog:
    stream: str
    consumer: str
    pending: int  # matching messages not yet delivered
    ack_pending: int  # delivered, not yet acknowledged


@dataclass(frozen=True)
class LogReading:
    last_seq: dict[str, int]  # per stream
    messages: dict[str, int]  # per stream
    dead_letters: dict[str, int]  # per original stream
    consumers: list[ConsumerBacklog] = field(default_factory=list)
    # Events of each type past the projector's applied sequence (empty: it is not behind);
    # None: too many to read, or nothing to read them after (the projection was not read).
    unapplied_by_type: dict[str, int] | None = field(default_factory=dict)


@dataclass(frozen=True)
class ProjectionReading:
    applied_seq: dict[str, int]  # projector -> last SHOAL_EVENTS sequence applied
    nodes: list[NodeRow]
    devices: list[DeviceRow]
    runners: list[RunnerRow]
    resumes: int = 0  # tasks' continuations after a lost runner, all tasks together
    # Events of each type the projector (the one this API reads) counted up to its sequence.
    events_by_type: dict[str, int] = field(default_factory=dict)
    keys: list[KeyRow] = field(default_factory=list)
    usage: list[UsageRow] = field(default_factory=list)


def cluster_families(
    events: LogReading | None, projection: ProjectionReading | None, projector: str = DEFAULT_NAME
) -> list[Metric]:
    """The cluster-wide metric families from what could be read (None: that source failed);
    ``projector`` is the one whose consumption is counted by type."""
    up = _gauge(
        "shoal_metrics_source_up",
        "Whether this scrape could read the source (nats: the log, database: the projection).",
        ["source"],
    )
    up.add_metric(["nats"], 1 if events is not None else 0)
    up.add_metric(["database"], 1 if projection is not None else 0)
    families: list[Metric] = [up]
    if events is not None:
        families += _log_families(events)
    if projection is not None:
        families += _projection_families(projection)
        consumed = _gauge(
            "shoal_events_consumed",
            "Events of each type a projector has "
            "applied (counted by it, malformed ones too, in the same transaction "
            "as its rows).",
            ["consumer", "type"],
        )
        for kind, n in sorted(_every_type(projection.events_by_type).items()):
            consumed.add_metric([f"projector:{projector}", kind], n)
        families.append(consumed)
        lost = CounterMetricFamily(
            "shoal_log_tail_lost",
            "Times the event log went back behind the projection (a power cut lost its unsynced"
            " tail) and the projection was rebuilt: the LogTailLost events in the log.",
        )
        lost.add_metric([], projection.events_by_type.get(LogTailLost.__name__, 0))
        families.append(lost)
    if events is not None and projection is not None:
        lag = _gauge(
            "shoal_projector_lag_events",
            "SHOAL_EVENTS' last sequence minus the last one the projector applied.",
            ["projector"],
        )
        last = events.last_seq.get(EVENTS_STREAM, 0)
        for name, seq in sorted(projection.applied_seq.items()):
            lag.add_metric([name], last - seq)
        families.append(lag)
        if events.unapplied_by_type is not None:
            in_log = _gauge(
                "shoal_events_in_log",
                "Events of each type appended to the event "
                "log: those the projector counted, and those past its applied "
                f"sequence (left out while it is more than {UNAPPLIED_READ_MAX} "
                "behind).",
                ["type"],
            )
            total = Tally(projection.events_by_type) + Tally(events.unapplied_by_type)
            for kind, n in sorted(_every_type(total).items()):
                in_log.add_metric([kind], n)
            families.append(in_log)
    return families


def _every_type(counts: Mapping[str, int]) -> dict[str, int]:
    """``counts`` with a 0 for each type of the events stream that has none."""
    return dict.fromkeys(event_type_filters(), 0) | dict(counts)


def _log_families(r: LogReading) -> list[Metric]:
    messages = _gauge("shoal_stream_messages", "Messages a stream holds.", ["stream"])
    last_seq = _gauge("shoal_stream_last_seq", "A stream's last sequence number.", ["stream"])
    for stream in sorted(r.messages):
        messages.add_metric([stream], r.messages[stream])
        last_seq.add_metric([stream], r.last_seq.get(stream, 0))
    dead = _gauge(
        "shoal_dead_letters",
        "Messages set aside as malformed or poisonous, by the "
        "stream they came from (kept for the dead-letter stream's max age).",
        ["stream"],
    )
    for stream in sorted({EVENTS_STREAM} | set(r.dead_letters)):
        dead.add_metric([stream], r.dead_letters.get(stream, 0))
    pending = _gauge(
        "shoal_consumer_pending_events",
        "Messages a durable consumer has yet to be delivered (a model's runners': tasks queued).",
        ["stream", "consumer"],
    )
    unacked = _gauge(
        "shoal_consumer_ack_pending_events",
        "Messages delivered to a durable consumer and not yet acknowledged.",
        ["stream", "consumer"],
    )
    for c in sorted(r.consumers, key=lambda c: (c.stream, c.consumer)):
        pending.add_metric([c.stream, c.consumer], c.pending)
        unacked.add_metric([c.stream, c.consumer], c.ack_pending)
    return [messages, last_seq, dead, pending, unacked]


def _projection_families(p: ProjectionReading) -> list[Metric]:
    applied = _gauge(
        "shoal_projector_applied_seq",
        "The last SHOAL_EVENTS sequence each projector applied (its tracking row).",
        ["projector"],
    )
    for name, seq in sorted(p.applied_seq.items()):
        applied.add_metric([name], seq)
    runners = _gauge("shoal_runners", "Runners (shards of placed instances) by state.", ["state"])
    by_state = Tally(r.state for r in p.runners)
    for state in RUNNER_STATES:
        runners.add_metric([state], by_state.get(state, 0))
    nodes = _gauge("shoal_nodes", "Nodes by status.", ["status"])
    by_status = Tally(n.status for n in p.nodes)
    for status in NODE_STATUSES:
        nodes.add_metric([status], by_status.get(status, 0))
    memory = _gauge(
        "shoal_node_memory_bytes",
        "An online node's RAM: total, available, and offered to placement (its latest profile).",
        ["node", "kind"],
    )
    load = _gauge(
        "shoal_node_cpu_load_percent", "An online node's CPU load, 0-100, all cores.", ["node"]
    )
    online = sorted((n for n in p.nodes if n.status == "online"), key=lambda n: n.node_id)
    for n in online:
        values = {"total": n.ram_total, "available": n.ram_available, "offered": n.memory_offered}
        for kind in MEMORY_KINDS:
            memory.add_metric([n.node_id, kind], values[kind])
        load.add_metric([n.node_id], n.cpu_load)
    gpu = _gauge(
        "shoal_device_memory_bytes",
        "An online node's GPU memory: total and used.",
        ["node", "device", "kind"],
    )
    online_ids = {n.node_id for n in online}
    for d in sorted(p.devices, key=lambda d: (d.node_id, d.device)):
        if d.kind == "gpu" and d.node_id in online_ids:
            gpu.add_metric([d.node_id, d.device, "total"], d.memory_total)
            gpu.add_metric([d.node_id, d.device, "used"], d.memory_used)
    resumes = CounterMetricFamily(
        "shoal_task_resumes",
        "Continuations of tasks after the runner serving them was lost (services/resume.py).",
    )
    resumes.add_metric([], p.resumes)
    return [applied, runners, nodes, memory, load, gpu, resumes, *_usage_families(p)]


def _usage_families(p: ProjectionReading) -> list[Metric]:
    """What each API key used, by model: requests and tokens of its tasks that ended."""
    names = {k.key_id: k.name for k in p.keys}
    requests = CounterMetricFamily(
        "shoal_key_requests",
        "Tasks an API key asked for that ended, by model.",
        labels=["key", "model"],
    )
    tokens = CounterMetricFamily(
        "shoal_tokens",
        "Tokens of an API key's ended tasks, by model: prompt (cached ones included), cached"
        " (of the prompt, not computed again) and completion.",
        labels=["key", "model", "kind"],
    )
    for u in sorted(p.usage, key=lambda u: (u.key_id, u.model_id)):
        key = names.get(u.key_id, u.key_id)
        requests.add_metric([key, u.model_id], u.requests)
        tokens.add_metric([key, u.model_id, "prompt"], u.prompt_tokens)
        tokens.add_metric([key, u.model_id, "cached"], u.cached_tokens)
        tokens.add_metric([key, u.model_id, "completion"], u.completion_tokens)
    return [requests, tokens]


def _gauge(name: str, documentation: str, labels: Sequence[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels))


async def read_log(js: JetStreamContext, applied_seq: int | None = None) -> LogReading:
    """Stream states, dead letters, durable consumers' backlogs, and the events by type past
    ``applied_seq`` (the projector's tracking row). Requests that only read: per-type counts
    come from the projection (``read_projection``), not from consumers made for a scrape."""
    last_seq: dict[str, int] = {}
    messages: dict[str, int] = {}
    dead: dict[str, int] = {}
    for stream in (EVENTS_STREAM, CHUNKS_STREAM, DEADLETTER_STREAM):
        subjects = ALL_DEAD_LETTERS if stream == DEADLETTER_STREAM else None
        info = await js.stream_info(stream, subjects_filter=subjects)
        last_seq[stream] = info.state.last_seq
        messages[stream] = info.state.messages
        if stream == DEADLETTER_STREAM:
            dead = dead_letters_by_stream(info.state.subjects or {})
    unapplied: dict[str, int] | None = None
    if applied_seq is not None:
        unapplied = await _types_after(js, applied_seq, last_seq[EVENTS_STREAM])
    consumers: dict[str, ConsumerBacklog] = {}
    listed = 0
    while True:
        page = await js.consumers_info(EVENTS_STREAM, offset=listed)
        listed += len(page)
        for c in page:
            # Ephemeral consumers (tails, ordered readers) come and go.
            if c.config.durable_name:
                consumers[c.name] = ConsumerBacklog(
                    EVENTS_STREAM, c.name, c.num_pending or 0, c.num_ack_pending or 0
                )
        if len(page) < CONSUMER_PAGE:
            break
    return LogReading(last_seq, messages, dead, list(consumers.values()), unapplied)


async def _types_after(js: JetStreamContext, after: int, last: int) -> dict[str, int] | None:
    """Events of each type on SHOAL_EVENTS after sequence ``after`` up to ``last``, by their
    subjects; None when there are more than UNAPPLIED_READ_MAX."""
    if last - after > UNAPPLIED_READ_MAX:
        return None

    async def subject(seq: int) -> str | None:
        try:
            return (await js.get_msg(EVENTS_STREAM, seq)).subject
        except NotFoundError:
            return None  # removed, or aged out

    subjects = await asyncio.gather(*(subject(seq) for seq in range(after + 1, last + 1)))
    return dict(Tally(t for s in subjects if s and (t := subject_event_type(s)) is not None))


async def read_projection(engine: AsyncEngine, projector: str) -> ProjectionReading:
    """Nodes, devices, runners, where each projector stands (``projector``, the one this API
    reads, at 0 until it has applied anything) and what it counted by type."""
    tables = (NodeRow.TABLE, DeviceRow.TABLE, RunnerRow.TABLE, KeyRow.TABLE, UsageRow.TABLE)
    async with engine.connect() as conn:
        state = await load_state(conn, tables)
        progress = await read_progress(conn, EVENTS_STREAM)
        resumes = await task_resumes(conn)
    applied = {projector: 0} | {name: p.last_seq for name, p in progress.items()}
    counts = progress[projector].events_by_type if projector in progress else {}
    return ProjectionReading(
        applied,
        state.nodes(),
        state.devices(),
        state.runners(),
        resumes,
        counts,
        list(state.key_rows.values()),
        list(state.usage_rows.values()),
    )


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
