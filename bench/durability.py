"""What an acknowledged event on disk costs: the embedded nats-server syncing every JetStream
write before its ack (``sync_interval: always``, Shoal's default) against nats-server's own
default (a sync every 2 minutes), side by side in one run; and SQLite's ``synchronous`` mode
for the projection (NORMAL, Shoal's, against FULL).

    .venv/bin/python -m bench.durability [--rounds 4] [--clients 4] [--requests 6]
                                         [--tokens 16] [--publishes 2000]

1. ``shoal up`` serving SmolLM2, started with ``SHOAL_NATS_SYNC=always`` and with ``=2m`` in
   turn (A B B A ..., one at a time): ``--clients`` clients each send ``--requests`` streamed
   chat completions of at most ``--tokens`` tokens back to back (short answers, so that the
   log's share of a request is as large as it gets). Requests/s over the wall time, and the
   time to first token (p50) as the client sees it.
2. Acknowledged publishes/s into an embedded server of each setting: one publisher waiting on
   each ack, and 16 at once.
3. SQLite in WAL mode, small transactions as the projector commits them (a tracking row and a
   few rows each): commits/s with ``synchronous=NORMAL`` and ``=FULL``.

Ratios are always / 2m (and FULL / NORMAL): a request rate or commit rate below 1 is the cost.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.common.chat import PROMPTS, HttpContender
from bench.common.processes import ShoalUp, shoal_env
from bench.common.report import med, print_head
from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.streams import ensure_streams
from events.catalogue import NodeJoined

SETTINGS = ("always", "2m")


async def _serve(up: ShoalUp, clients: int, requests: int, tokens: int) -> tuple[float, float]:
    """Requests/s and TTFT p50 (s) of one round against a ready `shoal up`."""
    async with httpx.AsyncClient(timeout=300) as client:
        contender = HttpContender("shoal", up.url, client)
        await contender.stream(PROMPTS[0], 4)  # warm
        ttfts: list[float] = []

        async def one_client(c: int) -> None:
            for i in range(requests):
                s = await contender.stream(PROMPTS[(c + i) % len(PROMPTS)], tokens)
                if s.pieces:
                    ttfts.append(s.pieces[0][0] - s.start)

        started = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.perf_counter() - started
    return clients * requests / wall, statistics.median(ttfts)


async def _round(tmp: Path, sync: str, n: int, args: argparse.Namespace) -> tuple[float, float]:
    up = ShoalUp(tmp, f"{sync}-{n}", threads=1)
    up.proc.start(shoal_env() | {"SHOAL_NATS_SYNC": sync})
    try:
        await up.wait_ready()
        return await _serve(up, args.clients, args.requests, args.tokens)
    finally:
        await up.stop()


async def _publishes(tmp: Path, sync: str, count: int, concurrent: int) -> float:
    """Acknowledged publishes/s into a fresh embedded server with ``sync``."""
    with EmbeddedNats(tmp / f"nats-{sync}-{concurrent}", sync=sync) as server:
        nc = await connect(server.url, name="bench")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            publisher = Publisher(js)

            async def publish(k: int) -> None:
                for i in range(count // concurrent):
                    await publisher.publish(NodeJoined(node_id=f"n{k}-{i}", origin="bench"))

            started = time.perf_counter()
            await asyncio.gather(*(publish(k) for k in range(concurrent)))
            return count / (time.perf_counter() - started)
        finally:
            await nc.close()


def _commits(path: Path, synchronous: str, count: int = 1000) -> float:
    """Commits/s of small transactions into SQLite in WAL mode."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute("CREATE TABLE IF NOT EXISTS rows (k INTEGER PRIMARY KEY, v TEXT)")
        db.execute("CREATE TABLE IF NOT EXISTS tracking (p TEXT PRIMARY KEY, seq INTEGER)")
        started = time.perf_counter()
        for i in range(count):
            db.execute("BEGIN")
            db.executemany(
                "INSERT OR REPLACE INTO rows VALUES (?, ?)",
                [(i * 4 + j, "x" * 200) for j in range(4)],
            )
            db.execute("INSERT OR REPLACE INTO tracking VALUES ('main', ?)", (i,))
            db.execute("COMMIT")
        return count / (time.perf_counter() - started)
    finally:
        db.close()


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-durability-") as d:
        tmp = Path(d)
        print_head(
            f"shoal up, SmolLM2-135M, {args.clients} clients x {args.requests} streamed"
            f" requests of <= {args.tokens} tokens, {args.rounds} rounds of each (A B B A)"
        )
        order = [
            s for r in range(args.rounds) for s in (SETTINGS if r % 2 == 0 else SETTINGS[::-1])
        ]
        served: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        for n, sync in enumerate(order):
            rate, first = await _round(tmp, sync, n, args)
            served[sync].append((rate, first))
            print(f"  sync {sync:>6}: {rate:6.2f} requests/s, TTFT p50 {first * 1000:6.0f} ms")
        rps = {s: med(r for r, _ in served[s]) for s in SETTINGS}
        ttft = {s: med(t for _, t in served[s]) for s in SETTINGS}
        print(
            f"  median: always {rps['always']:.2f} req/s, {ttft['always'] * 1000:.0f} ms;"
            f" 2m {rps['2m']:.2f} req/s, {ttft['2m'] * 1000:.0f} ms"
        )
        print(
            f"  ratio always/2m: requests/s {rps['always'] / rps['2m']:.3f}x,"
            f" TTFT p50 {ttft['always'] / ttft['2m']:.3f}x"
        )

        print_head(f"acknowledged publishes/s, {args.publishes} NodeJoined events")
        for concurrent in (1, 16):
            rates = {s: await _publishes(tmp, s, args.publishes, concurrent) for s in SETTINGS}
            print(
                f"  {concurrent:>2} publisher(s): always {rates['always']:7.0f}/s,"
                f" 2m {rates['2m']:7.0f}/s, ratio {rates['always'] / rates['2m']:.3f}x"
            )

        print_head("SQLite (WAL) commits/s of projector-sized transactions")
        commits = {m: _commits(tmp / f"{m}.db", m) for m in ("NORMAL", "FULL")}
        print(
            f"  NORMAL {commits['NORMAL']:7.0f}/s, FULL {commits['FULL']:7.0f}/s,"
            f" ratio FULL/NORMAL {commits['FULL'] / commits['NORMAL']:.3f}x"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--publishes", type=int, default=2000)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
