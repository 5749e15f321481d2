"""What every fault test asserts once the dust has settled, and the load that it checks.

(a) the live projection equals a fresh replay of the log, table by table and row by row,
    tracking row included;
(b) every event in the log was applied exactly once: the tracking row reached the stream's
    last sequence, no event id is stored twice, nothing was dead-lettered, at most one
    placement decision per instance generation;
(c) every request got an answer: a completion (200 with text, or a stream that ended with a
    finish reason and ``[DONE]``) or a clear error (OpenAI's error object, as the JSON body or
    as an SSE ``data: {"error": ...}`` event); never a hang, never a connection cut without a
    message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from nats.js import JetStreamContext
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, DEADLETTER_STREAM, EVENTS_STREAM
from events.catalogue import (
    ChunkGenerated,
    Event,
    InstancePlaced,
    PlacementRejected,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    parse_event,
)
from events.subjects import CHUNKS_PREFIX, EVENTS_PREFIX
from projectors import database
from projectors.replay import replay
from projectors.store import table_rows
from projectors.tables import STATE_TABLES, event_counts, projector_offsets
from tests.faults.cluster import MODEL, Cluster

Rows = dict[str, list[dict[str, Any]]]

# --- (a) and (b): the log and the projection ------------------------------------------------


@dataclass(frozen=True)
class Log:
    """The events stream as stored, in order, and the chunks by task."""

    events: list[tuple[int, Event]]
    chunks: dict[str, list[ChunkGenerated]]

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for _, e in self.events if isinstance(e, kind)]

    def text(self, task_id: str) -> str:
        return "".join(c.text for c in sorted(self.chunks.get(task_id, []), key=lambda c: c.idx))


async def read_log(js: JetStreamContext) -> Log:
    events = [
        (msg.metadata.sequence.stream, parse_event(msg.data))
        async for msg in read_stream(js, EVENTS_STREAM, f"{EVENTS_PREFIX}.>")
    ]
    chunks: dict[str, list[ChunkGenerated]] = {}
    async for msg in read_stream(js, CHUNKS_STREAM, f"{CHUNKS_PREFIX}.>"):
        chunk = parse_event(msg.data)
        assert isinstance(chunk, ChunkGenerated)
        chunks.setdefault(chunk.task_id, []).append(chunk)
    return Log(events, chunks)


async def read_log_once_ended(js: JetStreamContext, timeout: float = 30) -> Log:
    """The log once every task in it has an outcome (or as it is after ``timeout``): a client
    has its answer with its last chunk, a moment before the runner's outcome is stored (longer
    while the stream elects a leader)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        log = await read_log(js)
        ended = {e.task_id for e in log.of(TaskCompleted) + log.of(TaskFailed)}
        ended |= {e.task_id for e in log.of(TaskCancelled)}
        if all(t.task_id in ended for t in log.of(TaskCreated)) or loop.time() > deadline:
            return log
        await asyncio.sleep(0.5)


async def all_rows(engine: AsyncEngine) -> Rows:
    """Every state table's rows in key order, the tracking rows and the counts by type."""
    async with engine.connect() as conn:
        rows = {name: await table_rows(conn, name) for name in STATE_TABLES}
        offsets = await conn.execute(
            select(projector_offsets).order_by(projector_offsets.c.projector)
        )
        rows[projector_offsets.name] = [dict(r) for r in offsets.mappings()]
        counts = await conn.execute(
            select(event_counts).order_by(*event_counts.primary_key.columns)
        )
        rows[event_counts.name] = [dict(r) for r in counts.mappings()]
    return rows


async def replayed_rows(js: JetStreamContext, path: Path, until_seq: int) -> Rows:
    engine = database.create_engine(f"sqlite:///{path}")
    try:
        result = await replay(js, engine, until_seq=until_seq)
        assert result.skipped == 0, f"{result.skipped} malformed events in the log"
        return await all_rows(engine)
    finally:
        await engine.dispose()


async def check_log_and_projection(cluster: Cluster, timeout: float = 60) -> Log:
    """(a) and (b). Call once nothing publishes any more (``stop_all_but_projector``) and the
    projector runs; returns the log for the test's own checks."""
    assert cluster.projector is not None, "the projector must run to catch up"
    last = await cluster.last_seq()
    await cluster.wait_applied(last, timeout)
    assert await cluster.applied_seq() == last  # no further: nothing beyond the stream's end
    live = await all_rows(cluster.engine)
    assert await cluster.last_seq() == last, "something still publishes"

    # (a) The projection is exactly what the log folds to, tracking row and counts included.
    replay_db = cluster.tmp / f"replay-{time.monotonic_ns()}.db"
    replayed = await replayed_rows(cluster.js, replay_db, last)
    for table in (*STATE_TABLES, projector_offsets.name, event_counts.name):
        assert live[table] == replayed[table], f"table {table}: the projection != a replay"
    (tracking,) = live[projector_offsets.name]
    assert (tracking["projector"], tracking["stream"], tracking["last_seq"]) == (
        "main",
        EVENTS_STREAM,
        last,
    )
    assert tracking["last_digest"], "the tracking row keeps the digest of its event"

    # (b) Stored once each, none set aside, one decision per instance generation.
    log = await read_log(cluster.js)
    check_stored_once(log)
    assert log.events[-1][0] == last
    dead = await cluster.js.stream_info(DEADLETTER_STREAM)
    assert dead.state.messages == 0, "events were dead-lettered"
    decisions = Counter(
        (e.instance_id, e.generation)
        for e in log.of(InstancePlaced) + log.of(PlacementRejected)
        if e.generation is not None  # a decision without one was not a planner's
    )
    assert all(n == 1 for n in decisions.values()), f"two decisions for a generation: {decisions}"
    for task_id, chunks in log.chunks.items():
        assert sorted(c.idx for c in chunks) == list(range(len(chunks))), task_id
    return log


def check_stored_once(log: Log) -> None:
    """The log has no gap in its sequences and no event stored twice."""
    assert [seq for seq, _ in log.events] == list(range(1, len(log.events) + 1)), "a gap"
    ids = Counter(e.event_id for _, e in log.events)
    assert not [i for i, n in ids.items() if n > 1], "an event stored twice"


def check_tasks_ended(log: Log) -> None:
    """Every task in the log ended (completed, failed, or cancelled by its API), and none has
    two outcomes (the runner and its worker publish them under one message id)."""
    outcomes = Counter(e.task_id for e in log.of(TaskCompleted) + log.of(TaskFailed))
    assert all(n == 1 for n in outcomes.values()), f"two outcomes: {outcomes.most_common(3)}"
    ended = set(outcomes) | {e.task_id for e in log.of(TaskCancelled)}
    open_tasks = [t.task_id for t in log.of(TaskCreated) if t.task_id not in ended]
    assert not open_tasks, f"tasks without an outcome: {open_tasks}"


# --- (c): requests and their answers ---------------------------------------------------------

Kind = Literal["completed", "error", "hang", "cut"]
QUESTION = "What is the capital city of France? Answer in one word."


@dataclass
class Outcome:
    """How one request ended. ``completed``: text and a finish reason; ``error``: OpenAI's
    error object (``error``); ``hang``: no end within the test's deadline; ``cut``: the
    connection failed or the stream stopped without ``[DONE]`` or an error."""

    label: str
    api: str
    stream: bool
    kind: Kind = "hang"
    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    task_id: str | None = None
    detail: str = ""
    chunks: int = 0  # content pieces received (streams)
    done: bool = False  # a stream's closing "data: [DONE]" came
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def __str__(self) -> str:
        what = self.text if self.kind == "completed" else (self.error or self.detail)
        return f"{self.label} via {self.api} ({self.seconds:.1f}s): {self.kind} {what!r}"


def _clear_error(body: Any) -> dict[str, Any] | None:
    """OpenAI's error object, if ``body`` is one with a message."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= err.keys():
        return None
    message, kind = err["message"], err["type"]
    return err if isinstance(message, str) and message and isinstance(kind, str) else None


def _task_id(response_id: Any) -> str | None:
    # The API's ids are chatcmpl-<task id>.
    return response_id.split("-", 1)[1] if isinstance(response_id, str) else None


async def chat(
    client: httpx.AsyncClient,
    api: str,
    url: str,
    *,
    label: str,
    stream: bool,
    content: str = QUESTION,
    max_tokens: int = 8,
    deadline_s: float = 60.0,
    first_chunk: asyncio.Event | None = None,
    out: Outcome | None = None,
    extra: dict[str, Any] | None = None,
) -> Outcome:
    """One chat completion through the API at ``url``; ``first_chunk`` is set when a stream's
    first content arrives. ``out``, when given, is filled in as the answer comes; ``extra``
    goes into the request's body."""
    out = out or Outcome(label, api, stream)
    body = {
        "model": MODEL,
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    } | (extra or {})
    try:
        async with asyncio.timeout(deadline_s):
            if stream:
                await _streamed(client, f"{url}/v1/chat/completions", body, out, first_chunk)
            else:
                await _whole(client, f"{url}/v1/chat/completions", body, out)
    except TimeoutError:
        out.kind, out.detail = "hang", f"no end within {deadline_s:g}s"
    except httpx.TransportError as exc:
        out.kind, out.detail = "cut", f"{type(exc).__name__}: {exc}"
    out.seconds = time.monotonic() - out.started
    return out


async def _whole(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome) -> None:
    r = await client.post(url, json=body)
    out.status = r.status_code
    try:
        data = r.json()
    except ValueError:
        out.kind, out.detail = "cut", f"{r.status_code} without JSON: {r.text[:200]!r}"
        return
    if r.status_code == 200:
        choice = data["choices"][0]
        out.text = choice["message"]["content"]
        out.finish_reason = choice["finish_reason"]
        out.task_id = _task_id(data.get("id"))
        out.kind = "completed" if out.finish_reason and out.text else "cut"
        return
    out.error = _clear_error(data)
    out.kind = "error" if out.error is not None else "cut"
    out.detail = f"{r.status_code} {data!r}"[:300]


async def _streamed(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    out: Outcome,
    first_chunk: asyncio.Event | None,
) -> None:
    async with client.stream("POST", url, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            data = json.loads(await r.aread())
            out.error = _clear_error(data)
            out.kind = "error" if out.error is not None else "cut"
            out.detail = f"{r.status_code} {data!r}"[:300]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                out.done = True
                break
            event = json.loads(payload)
            if "error" in event:
                out.error = _clear_error(event)
                out.detail = payload[:300]
                continue
            out.task_id = out.task_id or _task_id(event.get("id"))
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    out.text += piece
                    out.chunks += 1
                    if first_chunk is not None:
                        first_chunk.set()
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    if out.error is not None:
        out.kind = "error"
    elif out.done and out.finish_reason is not None:
        out.kind = "completed"
    else:
        out.kind, out.detail = "cut", f"the stream ended without an end (done={out.done})"


async def load(
    apis: Sequence[str],
    urls: dict[str, str],
    n: int,
    *,
    label: str = "r",
    concurrency: int = 8,
    deadline_s: float = 60.0,
    max_tokens: int = 8,
) -> list[Outcome]:
    """``n`` chat requests spread over ``apis`` (names in ``urls``), every other one streamed,
    at most ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=10)) as client:

        async def one(i: int) -> Outcome:
            api = apis[i % len(apis)]
            async with gate:
                return await chat(
                    client,
                    api,
                    urls[api],
                    label=f"{label}{i}",
                    stream=i % 2 == 1,
                    max_tokens=max_tokens,
                    deadline_s=deadline_s,
                )

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def check_answered(
    outcomes: Sequence[Outcome], *, errors_allowed: bool = False, log: Log | None = None
) -> None:
    """(c): every request completed, or (when ``errors_allowed``) failed with a clear error.
    With the ``log``: a completion's text is exactly its chunks in the log, its usage counts
    each of their tokens once, and a task whose request failed ended (failed or cancelled) in
    the log as well."""
    bad = [o for o in outcomes if o.kind in ("hang", "cut")]
    assert not bad, "requests without a clear answer:\n" + "\n".join(map(str, bad))
    if not errors_allowed:
        failed = [o for o in outcomes if o.kind != "completed"]
        assert not failed, "requests that failed:\n" + "\n".join(map(str, failed))
    if log is None:
        return
    completed = {e.task_id: e for e in log.of(TaskCompleted)}
    created = {e.task_id for e in log.of(TaskCreated)}
    for o in outcomes:
        if o.kind == "completed":
            assert o.task_id is not None and o.task_id in completed, f"{o}: no TaskCompleted"
            assert o.text == log.text(o.task_id), f"{o}: the text is not the log's chunks"
            # Each generated token counted once, however often the task was resumed.
            tokens = sum(c.token_id is not None for c in log.chunks.get(o.task_id, []))
            usage = completed[o.task_id].usage
            assert usage.completion_tokens == tokens, f"{o}: {usage} for {tokens} tokens"
        elif o.task_id is not None:
            assert o.task_id in created, f"{o}: the task is not in the log"
