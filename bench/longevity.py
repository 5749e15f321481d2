"""Longevity: what a year of requests costs the projector, and what a long conversation costs
the log.

    .venv/bin/python -m bench.longevity [--tasks 1000000] [--small 10000] [--turns 100]

1. History. For a small and a large history synthesized straight into the log (``--small``
   and ``--tasks`` ended tasks, each TaskCreated + TaskStarted + TaskCompleted, a stored
   response every 20th task, and 200 models added; nodes, an instance and its runner), on
   SQLite in a nats-server of its own: the projector's catch-up rate (events/s), then a
   ``shoal projector`` process started over the caught-up database: its start time (spawn to
   "resuming after seq") and its memory (RSS once started); and ``GET /v1/state`` through a
   ``shoal api`` (median of 20). Targets: RSS <= 200 MB and start <= 5 s with the large
   history; the large within 1.5x of the small; catch-up >= 20,000 events/s.
2. Conversation. ``--turns`` turns of one chat through a `shoal up` (SmolLM2), each adding a
   user message of about 500 tokens and the assistant's answer, as an agent or a chat UI sends
   the whole conversation every turn: the bytes the log grows by (events and parts streams),
   turn by turn, against what the same events would have stored with the messages inline
   (the TaskCreated as it was before prompts were stored once). Past the model's context the
   runner answers 400, after the task is on the log: the bytes are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psutil
from nats.js import JetStreamContext
from nats.js.api import PubAck

from bench.common.processes import MODEL_ID, READY_TIMEOUT, SHOAL_BIN, shoal_up
from bench.common.report import print_head, verdict
from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port
from bus.publisher import MSG_ID_HEADER
from bus.stores.claim_check import staged
from bus.stores.parts import PARTS_STREAM
from bus.streams import EVENTS_STREAM, ensure_streams
from events.catalogue import (
    EventBase,
    InstancePlaced,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    ResponseStored,
    RunnerStateChanged,
    TaskCompleted,
    TaskCreated,
    TaskStarted,
)
from events.records import (
    ChatMessage,
    NodeProfile,
    SamplingParams,
    ShardAssignment,
    Timings,
    Usage,
)
from events.units import MiB
from harness.processes import Proc
from projectors import database
from projectors.projector import Projector, tune_gc

IN_FLIGHT = 4096  # publishes awaiting their ack


def history(tasks: int) -> Iterator[EventBase]:
    """A cluster, then ``tasks`` ended tasks (and their stored responses), oldest first."""
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    yield NodeJoined(node_id="n1", origin="n1", ts=t0, heartbeat_s=3600)
    profile = NodeProfile(
        ram_total=16 << 30, ram_available=8 << 30, cpu_count=8, memory_offered=8 << 30
    )
    yield ResourceProfiled(node_id="n1", origin="n1", ts=t0, profile=profile)
    for m in range(200):
        yield ModelAdded(
            model_id=f"model-{m}", origin="cli", ts=t0, n_layers=30, size_bytes=1 << 30
        )
    shard = ShardAssignment(runner_id="r1", node_id="n1", start_layer=0, end_layer=30, n_layers=30)
    yield InstancePlaced(
        instance_id="i1", model_id="model-0", shards=[shard], origin="planner", ts=t0
    )
    yield RunnerStateChanged(
        runner_id="r1", instance_id="i1", node_id="n1", state="Ready", origin="n1", ts=t0
    )
    step = timedelta(days=365) / max(tasks, 1)
    usage = Usage(prompt_tokens=40, completion_tokens=60)
    timings = Timings(ttft_ms=80.0, tokens_per_s=60.0, total_ms=1100.0)
    for i in range(tasks):
        ts = t0 + i * step
        task_id = f"task-{i:08d}"
        message = ChatMessage(role="user", content=f"question {i}")
        params = SamplingParams(max_tokens=64)
        yield TaskCreated(
            task_id=task_id,
            model_id="model-0",
            origin="api",
            ts=ts,
            messages=[message],
            params=params,
        )
        yield TaskStarted(
            task_id=task_id,
            model_id="model-0",
            origin="n1",
            ts=ts,
            runner_id="r1",
            instance_id="i1",
        )
        yield TaskCompleted(
            task_id=task_id,
            model_id="model-0",
            origin="n1",
            ts=ts,
            runner_id="r1",
            finish_reason="stop",
            usage=usage,
            timings=timings,
        )
        if i % 20 == 0:
            yield ResponseStored(
                response_id=f"resp_{task_id}",
                origin="api",
                ts=ts,
                task_id=task_id,
                model_id="model-0",
                response={"id": f"resp_{task_id}", "status": "completed"},
            )


async def publish(js: JetStreamContext, events: Iterator[EventBase]) -> int:
    """Publish with many acks in flight; returns the stream's last sequence."""
    pending: list[asyncio.Future[PubAck]] = []
    for e in events:
        pending.append(
            await js.publish_async(e.subject, e.to_json(), headers={MSG_ID_HEADER: e.event_id})
        )
        if len(pending) >= IN_FLIGHT:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    return (await js.stream_info(EVENTS_STREAM)).state.last_seq


async def one_history(tmp: Path, tasks: int) -> dict[str, float]:
    """Catch-up rate, projector start and memory, /v1/state latency, over ``tasks``."""
    db = f"sqlite:///{tmp / 'projection.db'}"
    with EmbeddedNats(tmp / "nats") as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        print(f"  publishing a history of {tasks:,} ended tasks ...", flush=True)
        last = await publish(js, history(tasks))
        engine = database.create_engine(db)
        await database.upgrade(engine)
        projector = Projector(js, engine, snapshot_every=0)
        stop = asyncio.Event()
        started = time.monotonic()
        running = asyncio.create_task(projector.run(stop))
        async with asyncio.timeout(3600):
            while projector.applied_seq < last:  # noqa: ASYNC110 (it signals no applied seq)
                await asyncio.sleep(0.02)
        rate = last / (time.monotonic() - started)
        stop.set()
        await running
        await engine.dispose()

        proj = Proc(
            "projector",
            [str(SHOAL_BIN), "projector", "--nats", server.url, "--db", db],
            tmp / "projector.log",
        )
        spawned = time.monotonic()
        proj.start()

        async def resumed() -> bool:
            return "resuming after seq" in proj.log()

        await proj.wait_for(resumed, "its start", READY_TIMEOUT)
        start_s = time.monotonic() - spawned
        await asyncio.sleep(1.0)
        rss = psutil.Process(proj.pid).memory_info().rss / MiB

        port = free_port("127.0.0.1")
        api = Proc(
            "api",
            [str(SHOAL_BIN), "api", "--nats", server.url, "--db", db, "--port", str(port)],
            tmp / "api.log",
        )
        api.start()
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def healthy() -> bool:
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await api.wait_for(healthy, "health", READY_TIMEOUT)
            took = []
            for _ in range(20):
                t = time.perf_counter()
                (await client.get("/v1/state")).raise_for_status()
                took.append((time.perf_counter() - t) * 1000)
        await api.astop()
        await proj.astop()
        await nc.close()
    return {
        "events": last,
        "rate": rate,
        "start_s": start_s,
        "rss": rss,
        "state_ms": statistics.median(took),
    }


async def histories(tmp: Path, small: int, large: int) -> bool:
    results = {}
    for tasks in (small, large):
        run_dir = tmp / f"history-{tasks}"
        run_dir.mkdir()
        results[tasks] = await one_history(run_dir, tasks)
    print()
    head = ("ended tasks", "events", "catch-up ev/s", "start s", "RSS MB", "/v1/state ms")
    widths = (12, 10, 14, 8, 7, 13)
    print_head(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for tasks, r in results.items():
        cells = [f"{tasks:,}", f"{r['events']:,.0f}", f"{r['rate']:,.0f}"]
        cells += [f"{r['start_s']:.2f}", f"{r['rss']:.0f}", f"{r['state_ms']:.1f}"]
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    big, few = results[large], results[small]
    checks = [
        (f"RSS with {large:,} ended tasks <= 200 MB", big["rss"] <= 200),
        (f"start with {large:,} ended tasks <= 5 s", big["start_s"] <= 5),
        (
            f"RSS {large:,} / {small:,}: {big['rss'] / few['rss']:.2f}x <= 1.5x",
            big["rss"] / few["rss"] <= 1.5,
        ),
        (
            f"start {large:,} / {small:,}: {big['start_s'] / few['start_s']:.2f}x <= 1.5x",
            big["start_s"] / few["start_s"] <= 1.5,
        ),
        (f"catch-up >= 20,000 events/s ({big['rate']:,.0f})", big["rate"] >= 20_000),
    ]
    for what, ok in checks:
        print(f"{verdict(ok):>4}  {what}")
    return all(ok for _, ok in checks)


def user_text(turn: int) -> str:
    """About 500 tokens of text, different each turn."""
    words = [f"point{turn}-{i}" if i % 7 == 0 else "the argument goes on" for i in range(160)]
    return f"Turn {turn}. " + " ".join(words)


async def stream_bytes(js: JetStreamContext) -> tuple[int, int]:
    events = (await js.stream_info(EVENTS_STREAM)).state.bytes
    parts = (await js.stream_info(PARTS_STREAM)).state.bytes
    return events, parts


async def conversation(tmp: Path, turns: int) -> bool:
    async with shoal_up(tmp, "conversation", threads=2) as up:
        assert up.nc is not None
        js = up.nc.jetstream()
        messages: list[dict[str, str]] = []
        rows: list[tuple[int, int, int, int]] = []  # turn, events+parts bytes, inline bytes, status
        async with httpx.AsyncClient(base_url=up.url, timeout=600) as client:
            for turn in range(1, turns + 1):
                messages.append({"role": "user", "content": user_text(turn)})
                before = await stream_bytes(js)
                r = await client.post(
                    "/chat/completions",
                    json={
                        "model": MODEL_ID,
                        "messages": messages,
                        "max_tokens": 8,
                        "temperature": 0,
                    },
                )
                await asyncio.sleep(0.3)  # the outcome's events stored
                after = await stream_bytes(js)
                grown = (after[0] - before[0]) + (after[1] - before[1])
                task = TaskCreated(
                    task_id="0" * 32,
                    model_id=MODEL_ID,
                    origin="api@bench",
                    messages=[ChatMessage.model_validate(m) for m in messages],
                    params=SamplingParams(max_tokens=8, temperature=0),
                )
                # The same events, the task's messages inline instead of its parts.
                inline = (
                    (after[0] - before[0]) - len(staged(task).task.to_json()) + len(task.to_json())
                )
                rows.append((turn, grown, inline, r.status_code))
                answer = (
                    r.json()["choices"][0]["message"]["content"]
                    if r.status_code == 200
                    else "(no answer)"
                )
                messages.append({"role": "assistant", "content": answer})
    print()
    print_head(
        f"{'turn':>5} {'log grew, bytes':>16} {'inline (before)':>16} {'ratio':>6} {'status':>7}"
    )
    for turn, grown, inline, status in rows:
        if turn in (1, 2, 5, 10, 25, 50, 75, 100) or turn == turns:
            print(f"{turn:>5} {grown:>16,} {inline:>16,} {inline / grown:>5.1f}x {status:>7}")
    total, total_inline = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{'all':>5} {total:>16,} {total_inline:>16,} {total_inline / total:>5.1f}x")
    late = statistics.median(r[1] for r in rows[-10:])
    early = statistics.median(r[1] for r in rows[1:11])
    flat = late <= 1.5 * early
    print(
        f"{verdict(flat):>4}  bytes per turn flat: median of the last 10 turns {late:,.0f},"
        f" of turns 2-11 {early:,.0f}"
    )
    return flat


async def run(args: argparse.Namespace) -> int:
    tune_gc()  # as every process that runs a projector does (shoal projector, shoal up)
    with tempfile.TemporaryDirectory(prefix="shoal-longevity-") as tmp:
        ok = True
        if args.tasks:
            print(f"history: {args.small:,} and {args.tasks:,} ended tasks")
            ok &= await histories(Path(tmp), args.small, args.tasks)
        if args.turns:
            print(f"\nconversation: {args.turns} turns of ~500 tokens")
            ok &= await conversation(Path(tmp), args.turns)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tasks", type=int, default=1_000_000, help="ended tasks of the large history (0: skip)"
    )
    parser.add_argument(
        "--small", type=int, default=10_000, help="ended tasks of the small history"
    )
    parser.add_argument(
        "--turns", type=int, default=100, help="turns of the conversation (0: skip)"
    )
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
