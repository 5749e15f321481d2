"""The cluster's half of ``GET /metrics`` (api/metrics.py): what the log and the projection
hold, read afresh at scrape time (stream states, dead letters, durable consumers' backlogs,
events by type, runners and nodes by state, node memory, usage by key), as metric families.
Reads only: it creates no consumer on the nats-server and writes nothing to the database."""

from __future__ import annotations

import asyncio
from collections import Counter as Tally
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.streams import CHUNKS_STREAM, DEADLETTER_STREAM, EVENTS_STREAM
from events.catalogue import LogTailLost, event_type_filters, subject_event_type
from events.states import NODE_STATUSES, RUNNER_STATES
from events.subjects import ALL_DEAD_LETTERS, dead_letter_origin
from projectors.projector import DEFAULT_NAME
from projectors.rows import DeviceRow, KeyRow, NodeRow, RunnerRow, UsageRow
from projectors.store import load_state, read_progress, task_resumes

# JetStream lists consumers in pages of this many.
CONSUMER_PAGE = 256
# Events past the projector's tracking row are read one by one (their subjects name their
# types) while there are at most this many; further behind, events by type in the log are left
# out of the scrape (the lag says how far behind it is).
UNAPPLIED_READ_MAX = 100

MEMORY_KINDS = ("total", "available", "offered")


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
    up = gauge(
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
        consumed = gauge(
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
        lag = gauge(
            "shoal_projector_lag_events",
            "SHOAL_EVENTS' last sequence minus the last one the projector applied.",
            ["projector"],
        )
        last = events.last_seq.get(EVENTS_STREAM, 0)
        for name, seq in sorted(projection.applied_seq.items()):
            lag.add_metric([name], last - seq)
        families.append(lag)
        if events.unapplied_by_type is not None:
            in_log = gauge(
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
    messages = gauge("shoal_stream_messages", "Messages a stream holds.", ["stream"])
    last_seq = gauge("shoal_stream_last_seq", "A stream's last sequence number.", ["stream"])
    for stream in sorted(r.messages):
        messages.add_metric([stream], r.messages[stream])
        last_seq.add_metric([stream], r.last_seq.get(stream, 0))
    dead = gauge(
        "shoal_dead_letters",
        "Messages set aside as malformed or poisonous, by the "
        "stream they came from (kept for the dead-letter stream's max age).",
        ["stream"],
    )
    for stream in sorted({EVENTS_STREAM} | set(r.dead_letters)):
        dead.add_metric([stream], r.dead_letters.get(stream, 0))
    pending = gauge(
        "shoal_consumer_pending_events",
        "Messages a durable consumer has yet to be delivered (a model's runners': tasks queued).",
        ["stream", "consumer"],
    )
    unacked = gauge(
        "shoal_consumer_ack_pending_events",
        "Messages delivered to a durable consumer and not yet acknowledged.",
        ["stream", "consumer"],
    )
    for c in sorted(r.consumers, key=lambda c: (c.stream, c.consumer)):
        pending.add_metric([c.stream, c.consumer], c.pending)
        unacked.add_metric([c.stream, c.consumer], c.ack_pending)
    return [messages, last_seq, dead, pending, unacked]


def _projection_families(p: ProjectionReading) -> list[Metric]:
    applied = gauge(
        "shoal_projector_applied_seq",
        "The last SHOAL_EVENTS sequence each projector applied (its tracking row).",
        ["projector"],
    )
    for name, seq in sorted(p.applied_seq.items()):
        applied.add_metric([name], seq)
    runners = gauge("shoal_runners", "Runners (shards of placed instances) by state.", ["state"])
    by_state = Tally(r.state for r in p.runners)
    for state in RUNNER_STATES:
        runners.add_metric([state], by_state.get(state, 0))
    nodes = gauge("shoal_nodes", "Nodes by status.", ["status"])
    by_status = Tally(n.status for n in p.nodes)
    for status in NODE_STATUSES:
        nodes.add_metric([status], by_status.get(status, 0))
    memory = gauge(
        "shoal_node_memory_bytes",
        "An online node's RAM: total, available, and offered to placement (its latest profile).",
        ["node", "kind"],
    )
    load = gauge(
        "shoal_node_cpu_load_percent", "An online node's CPU load, 0-100, all cores.", ["node"]
    )
    online = sorted((n for n in p.nodes if n.status == "online"), key=lambda n: n.node_id)
    for n in online:
        values = {"total": n.ram_total, "available": n.ram_available, "offered": n.memory_offered}
        for kind in MEMORY_KINDS:
            memory.add_metric([n.node_id, kind], values[kind])
        load.add_metric([n.node_id], n.cpu_load)
    gpu = gauge(
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


def gauge(name: str, documentation: str, labels: Sequence[str]) -> GaugeMetricFamily:
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
