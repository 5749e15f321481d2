"""Weights between machines: Shoal's fetch of a file by a second worker, side by side with what a
user with two machines and no Shoal would do (``curl`` from a plain HTTP file server), and with
a copy on the same disk for reference.

    .venv/bin/python -m bench.weights [--size-mb 1024] [--rounds 3] [--dir DIR]

It writes a file of random bytes (``--size-mb``) in ``--dir`` (the system's temporary
directory by default), starts its own nats-server with its store there too (the same disk),
makes two test hosts (``harness/hosts.py``: their own addresses; root needed) — the first
holds the file, the second fetches it, across their link (``--mbit`` limits its bandwidth) —
and measures, in alternating rounds (this machine is noisy: medians are printed):

- shoal: a first worker's cache holds the file (a link, as ``shoal up`` or ``shoal models add``
  leave it) and its weights server answers, in a process of its own; a second process, a
  worker with a cache of its own, runs ``fetch_files`` as a runner does: asks over NATS, takes
  the file over HTTP, hashes it as it writes, checks the digest;
- curl: ``curl -o`` of the same file from ``python -m http.server`` in a process of its own;
- copy: ``shutil.copyfile`` on the same disk (what ``cp`` does), once.

And once, for a model added from a machine with no worker: the file stored in the models
bucket (``store_files``) and fetched from it by the second process.

CPU seconds per GiB are given for each side of each transfer (client and server), read from
/proc. Target (issue 30): Shoal's fetch at least 0.8x curl's throughput; the fetching
process's memory flat (its peak at most 64 MiB above where it started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.common.procfs import HZ, descendants, named, process_ticks
from bench.common.report import med, print_head, verdict
from bus.connection import connect
from bus.embedded import EmbeddedNats, port_in_use
from bus.streams import ensure_streams
from events.catalogue import WeightFile
from events.units import GiB, MiB
from harness.hosts import Host, Network
from services.models.shared import fetch_files, store_files
from services.models.weights_cache import WeightsCache
from services.worker.weights_server import WeightsServer

TARGET_RATIO = 0.8
FLAT_MIB = 64.0
SAMPLE_S = 0.02
HTTP_PORT = 8080  # the plain file server's, on the first host


@dataclass
class Transfer:
    seconds: float
    client_cpu: float  # CPU seconds of the receiving process
    server_cpu: float  # of the sending one
    rss_growth_mib: float = 0.0


def _random_file(path: Path, size: int) -> None:
    block = os.urandom(MiB)
    with path.open("wb") as f:
        for i in range(size // MiB):
            # Each MiB differs (a repeated block would compress, or dedupe, somewhere).
            f.write(block[: MiB - 8] + i.to_bytes(8, "little"))


def _copy(src: Path, dst: Path) -> float:
    dst.unlink(missing_ok=True)
    start = time.perf_counter()
    shutil.copyfile(src, dst)
    elapsed = time.perf_counter() - start
    dst.unlink()
    return elapsed


# --- the processes ------------------------------------------------------------------------


async def _serve_here(url: str, src: Path, cache: Path, address: str) -> None:
    """The first worker's part: its cache holds ``src``; its weights server answers, at
    ``address``."""
    nc = await connect(url, name="bench-holder")
    try:
        (f,) = await store_files(
            nc.jetstream(), [(src.name, src)], cache=WeightsCache(cache), put=False
        )
        server = WeightsServer(WeightsCache(cache), address, "holder")
        server.start()
        await server.answer(nc)
        print(f.model_dump_json(), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # until told to stop
        server.stop()
    finally:
        await nc.close()


async def _fetch_here(url: str, files: list[WeightFile], cache: Path) -> None:
    """The second worker's part: one fetch each time it is told to go."""
    nc = await connect(url, name="bench-fetch")
    try:
        print("ready", flush=True)
        while sys.stdin.readline().strip() == "go":
            for f in files:
                WeightsCache(cache).blob(f.sha256).unlink(missing_ok=True)
            start, cpu = time.perf_counter(), time.process_time()
            await fetch_files(nc, WeightsCache(cache), files, node_id="fetcher")
            took = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}
            print(json.dumps(took), flush=True)
    finally:
        await nc.close()


class Fetcher:
    """The second worker's process, fetching when asked; its RSS sampled meanwhile."""

    def __init__(self, url: str, files: list[WeightFile], cache: Path, host: Host) -> None:
        argv = [
            sys.executable,
            "-m",
            "bench.weights",
            "--fetch",
            url,
            "--cache",
            str(cache),
            "--files",
            json.dumps([f.model_dump() for f in files]),
        ]
        self.proc = subprocess.Popen(
            host.argv(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        self.watched = psutil.Process(self.proc.pid)

    def fetch(self, server_pid: int) -> Transfer:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        before = self.watched.memory_info().rss
        peak, server_ticks = before, process_ticks(server_pid)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            line.append(self.proc.stdout.readline())

        reader = threading.Thread(target=read)
        reader.start()
        while reader.is_alive():
            peak = max(peak, self.watched.memory_info().rss)
            time.sleep(SAMPLE_S)
        if not line or not line[0].strip():
            raise SystemExit(f"the fetching process failed ({self.proc.poll()})")
        took = json.loads(line[0])
        server_cpu = (process_ticks(server_pid) - server_ticks) / HZ
        return Transfer(
            float(took["seconds"]), float(took["cpu"]), server_cpu, (peak - before) / MiB
        )

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def _curl(url: str, out: Path, server_pid: int, host: Host) -> Transfer:
    out.unlink(missing_ok=True)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_ticks = process_ticks(server_pid)
    start = time.perf_counter()
    subprocess.run(host.argv(["curl", "-sS", "--fail", "-o", str(out), url]), check=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    server_cpu = (process_ticks(server_pid) - server_ticks) / HZ
    out.unlink()
    return Transfer(seconds, cpu, server_cpu)


# --- the run --------------------------------------------------------------------------------


def _bucket(url: str, src: Path, work: Path, nats_pid: int, host: Host) -> tuple[float, Transfer]:
    """A model added where no worker runs: stored in the bucket, fetched from it."""

    async def store() -> tuple[list[WeightFile], float]:
        nc = await connect(url, name="bench-store")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            start = time.perf_counter()
            files = await store_files(js, [(src.name, src)])
            return files, time.perf_counter() - start
        finally:
            await nc.close()

    files, store_s = asyncio.run(store())
    fetcher = Fetcher(url, files, work / "bucket-fetcher", host)
    try:
        return store_s, fetcher.fetch(nats_pid)
    finally:
        fetcher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--mbit", type=float, default=None, help="the link's bandwidth")
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--fetch", help=argparse.SUPPRESS)  # the second worker's process
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the first worker's process
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fetch:
        files = [WeightFile.model_validate(f) for f in json.loads(args.files)]
        asyncio.run(_fetch_here(args.fetch, files, args.cache))
        return
    if args.serve:
        asyncio.run(_serve_here(args.serve, args.src, args.cache, args.address))
        return

    size = args.size_mb * MiB
    shoal: list[Transfer] = []
    curl: list[Transfer] = []
    with tempfile.TemporaryDirectory(prefix="bench-weights-", dir=args.dir) as tmp:
        work = Path(tmp)
        src = work / "weights.bin"
        _random_file(src, size)
        copy = _copy(src, work / "copy.bin")
        with (
            Network(work / "hosts", 2) as net,
            EmbeddedNats(work / "nats", host=net.gateway) as server,
        ):
            first, second = net.hosts
            for host in net.hosts:
                host.shape(args.mbit)
            nats_pid = next(p for p in descendants(os.getpid()) if named(p) == "nats-server")
            store_s, bucket = _bucket(server.url, src, work, nats_pid, second)
            holder = subprocess.Popen(
                first.argv(
                    [
                        sys.executable,
                        "-m",
                        "bench.weights",
                        "--serve",
                        server.url,
                        "--src",
                        str(src),
                        "--cache",
                        str(work / "holder"),
                        "--address",
                        first.address,
                    ]
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert holder.stdout is not None and holder.stdin is not None
            held = WeightFile.model_validate_json(holder.stdout.readline())
            port = HTTP_PORT
            http = subprocess.Popen(
                first.argv(
                    [
                        sys.executable,
                        "-m",
                        "http.server",
                        str(port),
                        "--bind",
                        first.address,
                        "--directory",
                        str(work),
                    ]
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            fetcher = Fetcher(server.url, [held], work / "fetcher", second)
            try:
                _wait_listening(first.address, port)
                for _ in range(args.rounds):
                    url = f"http://{first.address}:{port}/{src.name}"
                    curl.append(_curl(url, work / "c", http.pid, second))
                    shoal.append(fetcher.fetch(holder.pid))
            finally:
                fetcher.close()
                http.terminate()
                holder.stdin.close()
                holder.wait(30)
                http.wait(30)

    gib = size / GiB
    mb = size / 1e6
    print(
        f"\nweights between machines: a {args.size_mb} MiB file, {os.cpu_count()} cores,"
        f" two test hosts, {f'a {args.mbit:g} Mbit/s link' if args.mbit else 'the link unshaped'},"
        f" medians of {args.rounds} alternating rounds\n"
    )
    head = f"{'':<44}{'seconds':>9}{'MB/s':>8}{'client CPU s/GiB':>18}{'server':>8}"
    print_head(head)

    def row(label: str, runs: list[Transfer]) -> float:
        seconds = med(t.seconds for t in runs)
        client = med(t.client_cpu for t in runs) / gib
        server_cpu = med(t.server_cpu for t in runs) / gib
        print(f"{label:<44}{seconds:>9.2f}{mb / seconds:>8.0f}{client:>18.2f}{server_cpu:>8.2f}")
        return seconds

    shoal_s = row("shoal: second worker from the first's disk", shoal)
    curl_s = row("curl from python -m http.server", curl)
    print(f"{'copy on the same disk (reference)':<44}{copy:>9.2f}{mb / copy:>8.0f}")
    row("bucket: fetch (server: nats-server)", [bucket])
    print(f"{'bucket: store (hash + put), for reference':<44}{store_s:>9.2f}{mb / store_s:>8.0f}")
    ratio = curl_s / shoal_s
    growth = max(t.rss_growth_mib for t in shoal)
    print(
        f"\nshoal / curl throughput: {ratio:.2f}x (target >= {TARGET_RATIO}x:"
        f" {verdict(ratio >= TARGET_RATIO)}); shoal / bucket: {bucket.seconds / shoal_s:.1f}x"
    )
    print(
        f"fetching process RSS: at most +{growth:.0f} MiB during a fetch"
        f" (flat, <= +{FLAT_MIB:.0f}: {verdict(growth <= FLAT_MIB)})"
    )


def _wait_listening(host: str, port: int) -> None:
    deadline = time.monotonic() + 10
    while not port_in_use(host, port):
        if time.monotonic() > deadline:
            raise SystemExit("python -m http.server did not start")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
