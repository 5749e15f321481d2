"""Weights through NATS: a file stored in the models bucket and fetched by a second worker,
side by side with copying the file on the same disk.

    .venv/bin/python -m bench.weights [--size-mb 1024] [--dir DIR]

It writes a file of random bytes (``--size-mb``) in ``--dir`` (the system's temporary
directory by default), starts its own nats-server with its store there too (the same disk),
and measures:

- store: ``store_files`` from this process, as ``shoal models add`` does (the file hashed,
  then put in chunks with many in flight);
- fetch: ``fetch_files`` in a second process, a worker with a cache of its own, as a runner
  does (pulled in a bounded window, written and hashed in a thread, digest checked), its
  memory (RSS) sampled every 20 ms from before the fetch begins to its end;
- copy: the same file copied on the same disk (``shutil.copyfile``, what ``cp`` does), then
  again with an ``fsync`` of the copy (the bytes on the disk, not only in the page cache).

Targets (issue 23): the fetch at least half as fast as the copy; its memory flat (its peak at
most 64 MiB above where it started, whatever the file's size). Each figure is one run: on a
2-core machine shared with other work, ``others`` says how many cores the rest of the machine
used meanwhile (the main noise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.common.procfs import CpuWatch, descendants, named, tree_ticks
from bench.common.report import print_head, verdict
from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.events import WeightFile
from bus.streams import ensure_streams
from services.models.shared import fetch_files, store_files
from services.models.weights_cache import WeightsCache

MiB = 1024**2
TARGET_RATIO = 0.5
FLAT_MIB = 64.0
SAMPLE_S = 0.02


@dataclass
class Timed:
    seconds: float
    others: float  # cores the rest of the machine used meanwhile
    cpu: dict[str, float]  # CPU seconds of each part measured


def _random_file(path: Path, size: int) -> None:
    block = os.urandom(MiB)
    with path.open("wb") as f:
        for i in range(size // MiB):
            # Each MiB differs (a repeated block would compress, or dedupe, somewhere).
            f.write(block[: MiB - 8] + i.to_bytes(8, "little"))


def _copy(src: Path, dst: Path, sync: bool) -> float:
    dst.unlink(missing_ok=True)
    start = time.perf_counter()
    shutil.copyfile(src, dst)
    if sync:
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - start
    dst.unlink()
    return elapsed


async def _store(url: str, path: Path, cache: Path) -> tuple[list[WeightFile], float]:
    nc = await connect(url, name="bench-store")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        start = time.perf_counter()
        files = await store_files(js, [(path.name, path)], cache=WeightsCache(cache))
        return files, time.perf_counter() - start
    finally:
        await nc.close()


async def _fetch_here(url: str, files: list[WeightFile], cache: Path) -> None:
    """The second worker's part (in its own process)."""
    nc = await connect(url, name="bench-fetch")
    try:
        js = nc.jetstream()
        print("ready", flush=True)
        sys.stdin.readline()  # go
        start, cpu = time.perf_counter(), time.process_time()
        await fetch_files(js, WeightsCache(cache), files)
        took = {"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}
        print(json.dumps(took), flush=True)
    finally:
        await nc.close()


def _fetch_elsewhere(url: str, files: list[WeightFile], cache: Path, server_pid: int) -> tuple[
    Timed, float, float
]:  # fmt: skip
    """The fetch in a second process: its time, and its RSS at the start and at its peak."""
    argv = [sys.executable, "-m", "bench.weights", "--fetch", url, "--cache", str(cache),
            "--files", json.dumps([f.model_dump() for f in files])]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    watched = psutil.Process(proc.pid)
    before = watched.memory_info().rss
    peak = before
    watch = CpuWatch(lambda: {"nats": tree_ticks(server_pid)})
    proc.stdin.write("go\n")
    proc.stdin.flush()
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(SAMPLE_S)
    cpu, others = watch.stop()
    out = proc.stdout.read().strip().splitlines()
    if proc.returncode != 0 or not out:
        raise SystemExit(f"the fetching process failed ({proc.returncode})")
    took = json.loads(out[-1])
    # Its own CPU, as it measured it (gone from /proc by now), not among the others'.
    cpu["fetch"] = float(took["cpu"])
    others = max(0.0, others - cpu["fetch"] / float(took["seconds"]))
    return Timed(float(took["seconds"]), others, cpu), before / MiB, peak / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--fetch", help=argparse.SUPPRESS)  # the second worker's process
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fetch:
        files = [WeightFile.model_validate(f) for f in json.loads(args.files)]
        asyncio.run(_fetch_here(args.fetch, files, args.cache))
        return

    size = args.size_mb * MiB
    with tempfile.TemporaryDirectory(prefix="bench-weights-", dir=args.dir) as tmp:
        work = Path(tmp)
        src = work / "weights.bin"
        _random_file(src, size)
        copy = _copy(src, work / "copy.bin", sync=False)
        synced = _copy(src, work / "copy.bin", sync=True)
        with EmbeddedNats(work / "nats") as server:
            nats_pid = next(p for p in descendants(os.getpid()) if named(p) == "nats-server")
            store_watch = CpuWatch(lambda: {"nats": tree_ticks(nats_pid)})
            files, store_s = asyncio.run(_store(server.url, src, work / "first"))
            _, store_others = store_watch.stop()
            fetch, rss_before, rss_peak = _fetch_elsewhere(server.url, files, work / "second",
                                                           nats_pid)  # fmt: skip
        fetched = work / "second" / "blobs" / files[0].sha256
        assert fetched.stat().st_size == size

    mb = size / 1e6
    print(f"\nweights through NATS: a {args.size_mb} MiB file, {os.cpu_count()} cores\n")
    head = f"{'':<34}{'seconds':>9}{'MB/s':>9}{'others':>8}"
    print_head(head)
    print(f"{'store (hash + put), first worker':<34}{store_s:>9.2f}{mb / store_s:>9.0f}"
          f"{store_others:>8.2f}")  # fmt: skip
    print(f"{'fetch, second worker':<34}{fetch.seconds:>9.2f}{mb / fetch.seconds:>9.0f}"
          f"{fetch.others:>8.2f}")  # fmt: skip
    print(f"{'copy on the same disk':<34}{copy:>9.2f}{mb / copy:>9.0f}")
    print(f"{'copy + fsync':<34}{synced:>9.2f}{mb / synced:>9.0f}")
    ratio, ratio_synced = copy / fetch.seconds, synced / fetch.seconds
    growth = rss_peak - rss_before
    print(f"\nfetch / copy throughput: {ratio:.2f}x (target >= {TARGET_RATIO}x:"
          f" {verdict(ratio >= TARGET_RATIO)}); / copy + fsync: {ratio_synced:.2f}x")  # fmt: skip
    flat = verdict(growth <= FLAT_MIB)
    print(f"fetching process RSS: {rss_before:.0f} MiB before, {rss_peak:.0f} MiB at its peak"
          f" (+{growth:.0f} MiB; flat, <= +{FLAT_MIB:.0f}: {flat})")  # fmt: skip
    print(f"CPU during the fetch: fetching process {fetch.cpu['fetch']:.2f} s,"
          f" nats-server {fetch.cpu['nats']:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main()
