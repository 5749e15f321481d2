"""Soak: many streamed chat completions against a one-machine Shoal; no 5xx, no memory growth.

    .venv/bin/python -m bench.soak [--requests 1000] [--concurrency 16] [--max-tokens 16]
                                    [--warmup 50] [--warmup-s S] [--timeout 3600]
                                    [--runner-threads 2]
                                    [--growth-pct 20] [--growth-mib 50]

The cluster is what `shoal up` runs, on loopback, each part a process of its own so that each
one's memory is its own: nats-server (bus/embedded.py, JetStream in a temporary directory),
``shoal projector`` (SQLite), ``shoal planner``, ``shoal worker`` (which starts the runner, one
llama.cpp process serving SmolLM2-135M, ``smollm2-135m``, with ``--runner-threads`` threads) and
``shoal api``; the instance is asked for with ``shoal instances create``. `shoal up` runs the
same services in one process: its RSS would be the sum of API, projector, planner and worker,
and could not say which of them grew.

Load: ``--warmup`` requests first (not counted: lazy imports, caches, the allocator's first
high-water marks), and for at least ``--warmup-s`` seconds; with an events age limit, by
default, that limit and a round of the planner's janitor: until then the projection, its
database's page cache and the parts stream grow toward the size the limit holds them at, as
the first ended tasks are forgotten. Then ``--requests`` streamed chat completions,
``--concurrency`` at a time, with httpx.AsyncClient, each one user message (varied prompts: a
topic, a kind of text and the request's number, so no two are the same), ``--max-tokens``
tokens, temperature 0.7. The whole load is bounded by ``--timeout`` seconds; what has not
ended by then counts as not answered.

Per request: HTTP status; TTFT, from just before the request is sent to the arrival of the
first chunk with text; whether the stream ended normally (a finish reason, then ``[DONE]``);
an error, if any (a non-200 status, an error sent inside the stream, a broken connection). A
stream that has started cannot change its status line, so the API sends a late failure as an
error chunk: those of type ``server_error`` count as 5xx too.

Memory, with psutil, per part (RSS, and USS: the pages only that process holds): after the
warm-up ("before"), every 0.5 s during the load ("peak"; each minute's sample is printed as a
curve, which tells a cache filling to its bound from a leak), and 2 s after the last request
("after"). Growth = after - before.

Checks, each a PASS or FAIL line (exit status 1 on a FAIL): zero 5xx; every request answered
(HTTP 200 and a normal end); every Shoal process's RSS growth (API, projector, runner, planner,
worker) within the bound: at most ``--growth-pct`` % of its size after the warm-up and at most
``--growth-mib`` MiB (both). The defaults (20 %, 50 MiB) let through allocator noise (free
lists and arenas that stay mapped after a burst of 16 concurrent requests: a few MiB) and the
runner's KV cache and mmap'd weights paging in; they catch a leak of 25 KiB or more per request
over 1,000 requests (or a tenth of that over 10,000). The projector holds only what is live in
memory (no ended task), so a long run is held to less: ``--duration 1200 --growth-mib 5``, with
an events age limit (``SHOAL_EVENTS_MAX_AGE=5m``) so that the log's bound, the projector's
snapshots and the planner forgetting ended tasks show within the run. nats-server is shown, not
checked (it holds what its streams keep, bounded by their limits). Disk: the log's streams, the
snapshots and the projection database (bytes and task rows) after the warm-up and at the end;
with the age limit, each stays within what 5 minutes of requests make.

The figures depend on the machine and on what else runs: the report gives the load average
and the cores other processes used during the load. On a shared 2-core machine TTFT is
dominated by queueing: one runner serves one request at a time, so at concurrency 16 a
request waits for about 15 others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench.common import procfs
from bench.common.cluster import Cluster, log_bytes, projection_size, start_cluster
from bench.common.processes import MODEL_ID
from bench.common.report import verdict
from bus.streams import StreamSettings
from events.units import MiB
from services.planner import janitor

REQUEST_TIMEOUT = 600.0  # seconds for one request (queued behind others included)
SAMPLE_S = 0.5  # seconds between memory samples during the load
SERIES_S = 60.0  # seconds between the samples kept for the curve (a cache filling to its bound
# rises, then stays flat; a leak keeps rising)
SETTLE_S = 2.0  # seconds between the last request and the "after" sample
# parts whose memory growth is checked (nats-server's follows what its streams keep)
CHECKED = ("api", "projector", "runner", "planner", "worker")
PARTS = ("api", "projector", "runner", "planner", "worker", "nats-server")

TOPICS = (
    "lighthouses",
    "bees",
    "the moon",
    "bread",
    "rivers",
    "trains",
    "volcanoes",
    "chess",
    "owls",
    "glaciers",
    "libraries",
    "tea",
    "bicycles",
    "coral reefs",
    "clocks",
    "deserts",
)
KINDS = (
    "Write a short poem about {}.",
    "Explain {} to a child in two sentences.",
    "List three surprising facts about {}.",
    "Write the opening line of a story about {}.",
    "What would a museum of {} contain?",
)


def prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    kind = KINDS[(i // len(TOPICS)) % len(KINDS)]
    return f"{kind.format(topic)} (Request {i}.)"


# --- one request ----------------------------------------------------------------------------


@dataclass
class Result:
    status: int = 0  # HTTP status; 0: no response
    ttft: float | None = None  # seconds to the first chunk with text
    total: float = 0.0  # seconds to the end of the stream
    finish: str | None = None
    done: bool = False  # saw "[DONE]"
    pieces: int = 0  # chunks with text
    error: str = ""
    stream_error_type: str = ""  # "type" of an error sent inside the stream
    retry_after: float | None = None  # a 429's Retry-After, seconds

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.done and self.finish is not None and not self.error

    @property
    def refused(self) -> bool:
        """A clear 429: the model's queue was full (OpenAI's error, with Retry-After)."""
        return self.status == 429 and self.retry_after is not None and '"error"' in self.error

    @property
    def server_error(self) -> bool:
        return self.status >= 500 or self.stream_error_type == "server_error"


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> Result:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt(i)}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": True,
    }
    r = Result()
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = (await resp.aread()).decode(errors="replace")[:300]
                with contextlib.suppress(KeyError, ValueError):
                    r.retry_after = float(resp.headers["retry-after"])
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r.done = True
                    break
                chunk = json.loads(data)
                if err := chunk.get("error"):
                    r.error = str(err.get("message", err))[:300]
                    r.stream_error_type = str(err.get("type", ""))
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        r.pieces += 1
                        if r.ttft is None:
                            r.ttft = time.perf_counter() - start
                    if choice.get("finish_reason"):
                        r.finish = str(choice["finish_reason"])
    except (httpx.HTTPError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        r.total = time.perf_counter() - start
    return r


async def run_load(
    client: httpx.AsyncClient,
    url: str,
    first: int,
    n: int,
    concurrency: int,
    max_tokens: int,
    timeout: float,
    duration: float | None = None,
) -> tuple[list[Result], int, float]:
    """``n`` requests (as many as ``duration`` seconds take, given one), ``concurrency`` at a
    time, for at most ``timeout`` seconds. Returns the results of those that ended, how many
    did not, and the wall time."""
    queue = iter(range(first, first + n)) if duration is None else itertools.count(first)
    until = time.perf_counter() + duration if duration is not None else None
    results: list[Result] = []
    sent = 0

    async def worker() -> None:
        nonlocal sent
        for i in queue:
            if until is not None and time.perf_counter() > until:
                return
            sent += 1
            result = await one_request(client, url, i, max_tokens)
            results.append(result)
            if result.refused:  # as the SDKs do: wait as long as the API says
                await asyncio.sleep(min(result.retry_after or 1.0, 5.0))

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return results, sent - len(results), time.perf_counter() - start


# --- memory and CPU -------------------------------------------------------------------------


@dataclass(frozen=True)
class Mem:
    rss: int
    uss: int


def memory(pids: dict[str, list[int]]) -> dict[str, Mem]:
    out: dict[str, Mem] = {}
    for name, ps in pids.items():
        rss = uss = 0
        for pid in ps:
            with contextlib.suppress(psutil.Error):
                info = psutil.Process(pid).memory_full_info()
                rss += info.rss
                uss += info.uss
        out[name] = Mem(rss, uss)
    return out


def rss_only(pids: dict[str, list[int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, ps in pids.items():
        total = 0
        for pid in ps:
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).memory_info().rss
        out[name] = total
    return out


def other_load(ours: Sequence[int]) -> procfs.CpuWatch:
    """Cores used by processes outside the bench (``ours``) over a stretch of time."""
    return procfs.CpuWatch(lambda: {"ours": sum(procfs.process_ticks(p) for p in ours)})


async def sample_peaks(
    cluster: Cluster,
    peaks: dict[str, int],
    series: list[tuple[float, dict[str, int]]],
    stop: asyncio.Event,
) -> None:
    began = time.monotonic()
    while not stop.is_set():
        now = await asyncio.to_thread(rss_only, cluster.pids())
        for name, rss in now.items():
            peaks[name] = max(peaks.get(name, 0), rss)
        at = time.monotonic() - began
        if not series or at - series[-1][0] >= SERIES_S:
            series.append((at, now))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_S)


# --- report ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[max(0, int(q * 10) - 1)]


def mib(n: float) -> str:
    return f"{n / MiB:8.1f}"


def report(
    args: argparse.Namespace,
    results: list[Result],
    unfinished: int,
    wall: float,
    before: dict[str, Mem],
    after: dict[str, Mem],
    peaks: dict[str, int],
    series: list[tuple[float, dict[str, int]]],
    other_cores: float,
) -> bool:
    n = len(results) + unfinished
    answered = [r for r in results if r.answered]
    by_status: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status else "no response"
        if r.status == 200 and r.error:
            key += " + error in stream"
        by_status[key] = by_status.get(key, 0) + 1
    if unfinished:
        by_status["not ended within --timeout"] = unfinished
    server_errors = sum(r.server_error for r in results)
    pieces = sum(r.pieces for r in answered)
    print()
    print(
        f"requests: {n} sent, {len(answered)} answered (HTTP 200, stream ended with a finish"
        f" reason) in {wall:.1f} s: {len(answered) / wall:.2f} requests/s,"
        f" {pieces / wall:.1f} chunks with text/s"
    )
    print("  by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items())))
    finishes: dict[str, int] = {}
    for r in answered:
        finishes[r.finish or "?"] = finishes.get(r.finish or "?", 0) + 1
    print("  finish reasons: " + ", ".join(f"{k}: {v}" for k, v in sorted(finishes.items())))
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    for text, count in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  error x{count}: {text}")
    ttfts = sorted(r.ttft * 1000 for r in results if r.ttft is not None)
    totals = sorted(r.total * 1000 for r in answered)
    worst = max(ttfts, default=float("nan"))
    print(
        f"TTFT ms (to the first chunk with text, n={len(ttfts)}): "
        f"p50 {percentile(ttfts, 50):.0f}  p90 {percentile(ttfts, 90):.0f}  "
        f"p99 {percentile(ttfts, 99):.0f}  max {worst:.0f}"
    )
    print(
        f"whole request ms (answered, n={len(totals)}): p50 {percentile(totals, 50):.0f}  "
        f"p99 {percentile(totals, 99):.0f}"
    )
    print()
    print(
        f"memory, MiB      {'RSS before':>10} {'after':>8} {'growth':>8} {'':>7} "
        f"{'peak':>8} | {'USS before':>10} {'after':>8} {'growth':>8}"
    )
    for name in PARTS:
        b, a = before.get(name, Mem(0, 0)), after.get(name, Mem(0, 0))
        pct = (a.rss - b.rss) / b.rss * 100 if b.rss else 0.0
        print(
            f"  {name:<14} {mib(b.rss):>10} {mib(a.rss)} {mib(a.rss - b.rss)} {pct:+6.1f}% "
            f"{mib(peaks.get(name, 0))} | {mib(b.uss):>10} {mib(a.uss)} "
            f"{mib(a.uss - b.uss)}"
        )
    print(f"RSS, MiB, every {SERIES_S:.0f} s of the load:")
    for name in PARTS:
        print(f"  {name:<14} " + " ".join(f"{mib(now.get(name, 0))}" for _, now in series))
    load = os.getloadavg()
    print(
        f"other processes used {other_cores:.2f} cores on average during the load; load average"
        f" {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cpus"
    )
    print()
    ok = []
    ok.append(server_errors == 0)
    print(f"{verdict(ok[-1])}  zero 5xx: {server_errors}")
    refused = sum(r.refused for r in results)
    ok.append(len(answered) + refused == n)
    print(
        f"{verdict(ok[-1])}  every request answered or clearly refused (429 with Retry-After):"
        f" {len(answered)} + {refused} of {n}"
    )
    for name in CHECKED:
        was, now = before.get(name, Mem(0, 0)).rss, after.get(name, Mem(0, 0)).rss
        bound = min(was * args.growth_pct / 100, args.growth_mib * MiB)
        ok.append(was > 0 and now - was <= bound)
        pct = (now - was) / was * 100 if was else 0.0
        print(
            f"{verdict(ok[-1])}  {name} RSS growth {(now - was) / MiB:+.1f} MiB ({pct:+.1f}%)"
            f" <= {bound / MiB:.1f} MiB ({args.growth_pct:g}% of {was / MiB:.1f} MiB, at most"
            f" {args.growth_mib:g} MiB)"
        )
    return all(ok)


# --- main -----------------------------------------------------------------------------------


def default_warmup_s() -> float:
    """With an events age limit, the load before measuring: the limit, and a round of the
    planner's janitor, which forgets the tasks that ended before it (0 without one)."""
    settings = StreamSettings.from_env()
    if settings is None or not settings.events_max_age:
        return 0.0
    return settings.events_max_age + janitor.EVERY_S


async def run(args: argparse.Namespace, tmp: Path) -> int:
    started = time.perf_counter()
    warmup_s = args.warmup_s if args.warmup_s is not None else default_warmup_s()
    cluster = await start_cluster(tmp, args.runner_threads, args.max_queued)
    url = f"{cluster.api_url}/v1/chat/completions"
    runner_before: list[int] = []
    try:
        up_s = time.perf_counter() - started
        pids = cluster.pids()
        runner_before = pids["runner"]
        machine = f"{os.cpu_count()} cpus, {args.runner_threads} runner threads"
        print(
            f"soak: {f'{args.duration:.0f} s of' if args.duration else args.requests} streamed"
            f" chat completions of {MODEL_ID}, max_tokens"
            f" {args.max_tokens}, concurrency {args.concurrency}, after {args.warmup} warm-up"
            f" requests{f' and {warmup_s:.0f} s' if warmup_s else ''}; {machine}"
        )
        print(
            f"cluster: nats-server, shoal projector (SQLite), planner, worker + runner, api as"
            f" separate processes on loopback; serving after {up_s:.1f} s; pids "
            + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in pids.items())
        )
        limits = httpx.Limits(max_connections=args.concurrency * 2)
        timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            warm, warm_left, warm_wall = await run_load(
                client, url, 0, args.warmup, args.concurrency, args.max_tokens, args.timeout
            )
            if warm_wall < warmup_s:
                more, more_left, more_wall = await run_load(
                    client,
                    url,
                    len(warm) + warm_left,
                    0,
                    args.concurrency,
                    args.max_tokens,
                    args.timeout,
                    warmup_s - warm_wall,
                )
                warm, warm_left, warm_wall = (
                    warm + more,
                    warm_left + more_left,
                    warm_wall + more_wall,
                )
            bad_warm = sum(not r.answered for r in warm) + warm_left
            print(
                f"warm-up: {len(warm) + warm_left} requests in {warm_wall:.1f} s"
                + (f" ({bad_warm} not answered)" if bad_warm else "")
            )
            first_measured = len(warm) + warm_left
            before = await asyncio.to_thread(memory, cluster.pids())
            print(f"log after the warm-up: {await log_bytes(cluster.nats.url)}")
            print(f"projection after the warm-up: {projection_size(cluster.db)}")
            peaks: dict[str, int] = {}
            stop = asyncio.Event()
            series: list[tuple[float, dict[str, int]]] = []
            sampler = asyncio.create_task(sample_peaks(cluster, peaks, series, stop))
            ours = [os.getpid(), *(p for ps in cluster.pids().values() for p in ps)]
            watch = other_load(ours)
            results, unfinished, wall = await run_load(
                client,
                url,
                first_measured,
                args.requests,
                args.concurrency,
                args.max_tokens,
                args.timeout,
                args.duration,
            )
            other = watch.other_cores()
            stop.set()
            await sampler
        await asyncio.sleep(SETTLE_S)
        after_pids = cluster.pids()
        after = await asyncio.to_thread(memory, after_pids)
        ok = report(args, results, unfinished, wall, before, after, peaks, series, other)
        print(f"log at the end: {await log_bytes(cluster.nats.url)}")
        print(f"projection at the end: {projection_size(cluster.db)}")
        if after_pids["runner"] != runner_before:
            print(
                f"FAIL  the runner changed during the run: pids {runner_before} ->"
                f" {after_pids['runner']}"
            )
            ok = False
        print(f"(bench wall time {time.perf_counter() - started:.0f} s)")
        return 0 if ok else 1
    finally:
        print("; ".join(cluster.stop()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1000, help="requests measured")
    parser.add_argument("--concurrency", type=int, default=16, help="requests at a time")
    parser.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="the API's queue bound per model (shoal api --max-queued)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--warmup", type=int, default=50, help="requests before measuring")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="seconds of load before measuring, at least (default: the events' age limit and"
        " a janitor round when SHOAL_EVENTS_MAX_AGE is set, else 0)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds the measured load may take, in all"
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds of load (instead of --requests)"
    )
    parser.add_argument("--runner-threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument(
        "--growth-pct",
        type=float,
        default=20.0,
        help="RSS growth allowed, %% of the size after the warm-up",
    )
    parser.add_argument(
        "--growth-mib",
        type=float,
        default=50.0,
        help="RSS growth allowed, MiB (the smaller bound applies)",
    )
    args = parser.parse_args(argv)
    if min(args.requests, args.concurrency, args.max_tokens, args.runner_threads) < 1:
        parser.error("--requests, --concurrency, --max-tokens and --runner-threads must be >= 1")
    if args.warmup < 0 or args.timeout <= 0 or (args.warmup_s or 0) < 0:
        parser.error("--warmup and --warmup-s must be >= 0 and --timeout > 0")
    with tempfile.TemporaryDirectory(prefix="shoal-bench-soak-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
