"""Projector throughput: live catch-up and replay, on SQLite and PostgreSQL, side by side.

    .venv/bin/python -m bench.projector [--events N] [--repeat K] [--profile]

It starts its own nats-server (never the one on 4222), publishes a realistic history of N
events to SHOAL_EVENTS *before* any clock starts (token chunks are left out: they live on
SHOAL_CHUNKS, which the projector does not read), then measures, for each backend:

- live: ``Projector.run`` on a fresh, already migrated database, timed from the start of the
  task (consumer creation and the no-op ``upgrade`` in ``run`` included) until
  ``applied_seq`` reaches the stream's last sequence, i.e. pure catch-up, batches applied in one
  transaction each with the tracking row, acked after commit;
- replay: ``replay(js, engine)`` into another fresh database. Its migrations are applied before
  the clock starts, so the timed part (including replay's own no-op ``upgrade`` and its
  emptiness check) is the fold and the writes, as for live.

PostgreSQL uses the server named by SHOAL_BENCH_POSTGRES_URL (or SHOAL_TEST_POSTGRES_URL): each
measurement gets a database created for it, dropped at the end. Without either variable the
PostgreSQL rows are skipped. Targets (issue 2): 20,000 events/s on SQLite, 10,000 on PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import inspect
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import PubAck
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common.report import print_head, print_profile, verdict
from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import MSG_ID_HEADER
from bus.streams import EVENTS_STREAM, ensure_streams
from harness.databases import ScratchDatabases
from harness.history import history
from projectors import database
from projectors.projector import DEFAULT_NAME, Projector, tune_gc
from projectors.replay import replay
from projectors.store import read_offset
from projectors.tables import STATE_TABLES

POSTGRES_ENVS = ("SHOAL_BENCH_POSTGRES_URL", "SHOAL_TEST_POSTGRES_URL")
TARGETS = {"sqlite": 20_000.0, "postgresql": 10_000.0}
PUBLISH_WINDOW = 2_000  # publishes in flight (nats-py allows 4,000 by default)
CATCH_UP_LIMIT = 900.0  # seconds before a live measurement is declared stuck
DEFAULT_BATCH: int = inspect.signature(Projector).parameters["batch_size"].default


@dataclass(frozen=True)
class Measurement:
    backend: str
    mode: str  # "live" or "replay"
    events: int
    seconds: float
    counts: dict[str, int]  # rows per state table afterwards
    tracked_seq: int  # the tracking row's last_seq afterwards
    startup: float = 0.0  # live only: seconds until the projector's consumer was ready

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


# --- databases ------------------------------------------------------------------------------


def postgres_base_url() -> str | None:
    for name in POSTGRES_ENVS:
        value = os.environ.get(name)
        if value:
            return value
    return None


async def table_counts(engine: AsyncEngine) -> tuple[dict[str, int], int]:
    async with engine.connect() as conn:
        counts: dict[str, int] = {}
        for name, table in STATE_TABLES.items():
            q = select(func.count()).select_from(table)
            counts[name] = int((await conn.execute(q)).scalar_one())
        return counts, await read_offset(conn, DEFAULT_NAME, EVENTS_STREAM)


# --- the log ----------------------------------------------------------------------------------


async def publish_history(js: JetStreamContext, n_events: int) -> int:
    """Publish the first ``n_events`` events of a long history that go to SHOAL_EVENTS.
    A task makes about three such events, so ``n_events / 3`` tasks are enough."""
    pending: list[asyncio.Future[PubAck]] = []
    published = 0
    for event in history(n_tasks=n_events // 3 + 100, seed=1):
        if event.on_chunk_stream:
            continue  # chunks: the projector does not read their stream
        subject = event.subject
        if published == n_events:
            break
        fut = await js.publish_async(
            subject, event.to_json(), headers={MSG_ID_HEADER: event.event_id}
        )
        pending.append(fut)
        published += 1
        if len(pending) >= PUBLISH_WINDOW:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    return published


# --- measurements -----------------------------------------------------------------------------


async def measure_live(
    js: JetStreamContext,
    url: str,
    backend: str,
    last_seq: int,
    events: int,
    batch_size: int,
    profiler: cProfile.Profile | None = None,
) -> Measurement:
    engine = database.create_engine(url)
    try:
        await database.upgrade(engine)  # not timed
        gc.collect()  # every measurement starts from the same heap, without the last one's garbage
        # Catching up, every batch is full but the last: its linger would only add 0.25 s.
        # No snapshots: each run folds the whole log (a later run would start from an earlier
        # run's snapshot; bench.longevity measures starts from one).
        projector = Projector(
            js, engine, batch_size=batch_size, task_linger_s=0.0, snapshot_every=0
        )
        stop = asyncio.Event()
        startup = 0.0
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        task = asyncio.create_task(projector.run(stop))
        while projector.applied_seq < last_seq:
            if task.done():
                task.result()
                raise RuntimeError("the projector stopped before catching up")
            if not startup and projector.ready.is_set():
                startup = time.perf_counter() - t0
            if time.perf_counter() - t0 > CATCH_UP_LIMIT:
                raise RuntimeError(
                    f"live {backend}: stuck at seq {projector.applied_seq} of {last_seq}"
                )
            await asyncio.sleep(0.001)
        seconds = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        counts, tracked = await table_counts(engine)
    finally:
        await engine.dispose()
    return Measurement(backend, "live", events, seconds, counts, tracked, startup)


async def measure_replay(js: JetStreamContext, url: str, backend: str) -> Measurement:
    engine = database.create_engine(url)
    try:
        await database.upgrade(engine)  # not timed
        gc.collect()  # every measurement starts from the same heap, without the last one's garbage
        t0 = time.perf_counter()
        result = await replay(js, engine, from_snapshot=False)  # the whole log, every time
        seconds = time.perf_counter() - t0
        if result.skipped:
            raise RuntimeError(f"replay {backend} skipped {result.skipped} events")
        counts, tracked = await table_counts(engine)
    finally:
        await engine.dispose()
    return Measurement(backend, "replay", result.applied, seconds, counts, tracked)


# --- report -----------------------------------------------------------------------------------


def print_table(best: list[Measurement]) -> None:
    header = (
        f"{'backend':<11} {'mode':<7} {'events':>8} {'seconds':>9} {'events/s':>10} "
        f"{'target':>8} {'ratio-to-target':>16}"
    )
    print_head(header)
    for m in best:
        target = TARGETS[m.backend]
        ratio = m.rate / target
        said = verdict(ratio >= 1.0)
        print(
            f"{m.backend:<11} {m.mode:<7} {m.events:>8,} {m.seconds:>9.3f} {m.rate:>10,.0f} "
            f"{target:>8,.0f} {ratio:>10.2f}x {said:>4}"
        )


def check_rows(runs: list[Measurement], last_seq: int) -> bool:
    """Live and replay must end with the same row counts and the same tracking row, on every
    backend; tasks are printed."""
    ok = True
    reference = runs[0].counts
    for m in runs:
        if m.counts != reference or m.tracked_seq != last_seq:
            ok = False
    print(
        "rows in tasks: " + ", ".join(f"{m.backend} {m.mode} {m.counts['tasks']:,}" for m in runs)
    )
    if ok:
        others = ", ".join(f"{k} {v}" for k, v in reference.items() if k != "tasks")
        print(f"check: row counts equal in every table and database ({others})")
        print(f"check: tracking row at seq {last_seq:,} in every database")
    else:
        print("check FAILED:")
        for m in runs:
            print(f"  {m.backend} {m.mode}: {m.counts} tracked_seq={m.tracked_seq}")
    return ok


def configure_gc(python_default: bool) -> str:
    """The collector as `shoal projector` / `shoal replay` tune it, or Python's default."""
    gc.collect()
    if python_default:
        return f"Python default, thresholds {gc.get_threshold()}"
    tune_gc()
    return f"as shipped (projectors.projector.tune_gc), thresholds {gc.get_threshold()}"


# --- main -------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, nats_url: str, tmp: Path) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in TARGETS:
            raise SystemExit(f"unknown backend {b!r}: choose from {', '.join(TARGETS)}")
    postgres_url = postgres_base_url()
    if "postgresql" in backends and postgres_url is None:
        print(f"PostgreSQL skipped: set {' or '.join(POSTGRES_ENVS)} to include it")
        backends.remove("postgresql")

    nc = await connect(nats_url, name="shoal-bench")
    dbs = ScratchDatabases(tmp, postgres_url, prefix="shoal_bench")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        t0 = time.perf_counter()
        published = await publish_history(js, args.events)
        info = await js.stream_info(EVENTS_STREAM)
        last_seq, events = info.state.last_seq, info.state.messages
        print(
            f"published {published:,} events to {EVENTS_STREAM} in "
            f"{time.perf_counter() - t0:.1f}s (untimed); stream holds {events:,}, "
            f"last seq {last_seq:,}"
        )
        print(
            f"live: Projector batch_size={args.batch_size}, timed from task start to "
            f"applied_seq == {last_seq:,}; replay: migrations applied before timing"
        )
        print(f"gc: {configure_gc(args.python_gc)}")

        best: dict[tuple[str, str], Measurement] = {}
        last_runs: list[Measurement] = []
        for rep in range(args.repeat):
            last_runs = []
            for backend in backends:
                live = await measure_live(
                    js,
                    await dbs.new(backend, "live"),
                    backend,
                    last_seq,
                    events,
                    args.batch_size,
                )
                rep_ = await measure_replay(js, await dbs.new(backend, "replay"), backend)
                for m in (live, rep_):
                    last_runs.append(m)
                    key = (m.backend, m.mode)
                    if key not in best or m.seconds < best[key].seconds:
                        best[key] = m
                if args.repeat > 1:
                    print(
                        f"  run {rep + 1}/{args.repeat} {backend}: live {live.rate:,.0f}/s, "
                        f"replay {rep_.rate:,.0f}/s"
                    )
            await dbs.cleanup()

        print()
        title = f"best of {args.repeat}" if args.repeat > 1 else "one run each"
        print(f"Projector throughput, {events:,} events, {title}:")
        ordered = [best[(b, m)] for b in backends for m in ("live", "replay")]
        print_table(ordered)
        print()
        for b in backends:
            live, rep_ = best[(b, "live")], best[(b, "replay")]
            print(
                f"replay/live on {b}: {rep_.rate / live.rate:.2f}x "
                f"(live startup until the consumer was ready: {live.startup * 1000:.0f} ms)"
            )
        ok = check_rows(last_runs, last_seq)

        if args.profile and "sqlite" in backends:
            profiler = cProfile.Profile()
            m = await measure_live(
                js,
                await dbs.new("sqlite", "profile"),
                "sqlite",
                last_seq,
                events,
                args.batch_size,
                profiler,
            )
            print(f"\nprofiled live SQLite run: {m.seconds:.3f}s, {m.rate:,.0f} events/s")
            print_profile(profiler, "live SQLite (main thread only)", args.profile_top)
        return 0 if ok else 1
    finally:
        await dbs.cleanup()
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=100_000, help="events on SHOAL_EVENTS")
    parser.add_argument("--repeat", type=int, default=1, help="take the best of K runs")
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH, help="Projector batch_size"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also profile one live SQLite run (cProfile)"
    )
    parser.add_argument(
        "--python-gc",
        action="store_true",
        help="measure with Python's default GC instead of the projector's tuning",
    )
    parser.add_argument("--profile-top", type=int, default=30, help="profile lines to print")
    args = parser.parse_args(argv)
    if args.events < 1 or args.repeat < 1:
        parser.error("--events and --repeat must be at least 1")
    with (
        tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp,
        EmbeddedNats(Path(tmp) / "nats") as srv,
    ):
        return asyncio.run(run(args, srv.url, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
