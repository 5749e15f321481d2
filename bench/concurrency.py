"""Many users at once: Shoal against llama.cpp's own server, side by side, in one run.

    .venv/bin/python -m bench.concurrency [--models smollm2-135m,gemma3-270m]
                                          [--levels 1,4,8,16] [--tokens 128] [--threads 2]
                                          [--slots 8] [--per-client 2] [--no-llama-cpp-python]
                                          [--no-two-replicas]

Contenders, one after the other (never two at once), each serving the same GGUF with the same
threads (``--threads`` for generation and prompts):

1. ``llama-server`` (llama.cpp's server, built by ``bench.common.llama_server`` from the llama.cpp
   that llama-cpp-python's source distribution carries: the same engine version, the same CPU
   build flags) with ``--parallel SLOTS --cont-batching`` and ``SLOTS x 2048`` of context;
2. ``llama_cpp.server`` (llama-cpp-python's own server; one request at a time);
3. ``shoal up --slots SLOTS`` (one replica);
4. ``shoal up`` with two replicas of half the threads each, at the two highest levels.

At each concurrency level ``c``, ``c`` clients each send ``--per-client`` streamed chat
completions (or more, so that a level sends at least 8) back to back (varied prompts that ask
for long texts, greedy, ``--tokens`` tokens at most). Figures, from the client's side:

- aggregate tokens/s: every completion token (usage, or content chunks where there is none)
  over the wall time from the first request sent to the last stream ended;
- TTFT: from just before a request is sent to its first chunk with text (p50, p95);
- inter-token latency: per request, (last chunk with text - first) / (tokens - 1), then p50 and
  p95 over the requests (Shoal sends chunks in groups at most 50 ms apart, which this
  definition does not mind).

Then the prompt cache, against llama-server and Shoal: the TTFT of a 1,500-token conversation's
first turn, and of its second (the first's prompt and answer, and a short question).

Ratios are Shoal / llama-server at the same level. Targets (issue 19): tokens/s >= 0.9x at 8
and 16, >= 0.97x at 1, TTFT p50 at 8 <= 1.25x, a second turn >= 5x sooner; a missed target is
a MISSED line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common.chat import LONG_TURN, PROMPTS, TOPICS
from bench.common.llama_server import llama_server
from bench.common.processes import (
    READY_TIMEOUT,
    gguf,
    python_server_argv,
    serving_replicas,
    shoal_env,
    shoal_up_argv,
    wait_http,
    wait_shoal_ready,
)
from bench.common.report import verdict
from bus.embedded import free_port
from harness.processes import Proc
from services.models.catalogue import card_for

N_CTX = 2048
# Requests a level sends at least: at concurrency 1, two requests (a few seconds) made the
# ratio swing by several per cent from run to run.
MIN_REQUESTS = 8
REQUEST_TIMEOUT = 900.0


def prompt(i: int) -> str:
    """Varied prompts: no two requests of a level share more than the chat template."""
    base = PROMPTS[i % len(PROMPTS)]
    return f"{base} Make it about {TOPICS[i % len(TOPICS)]} (story number {i})."


# --- one request -----------------------------------------------------------------------------


@dataclass
class Seen:
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    chunks: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def itl(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int) -> Seen:
    seen = await _one(client, url, model, i, tokens)
    if seen.error and seen.error.startswith("RemoteProtocolError") and seen.first is None:
        # llama-server now and then closes a kept-alive connection as it is reused, before any
        # answer: asked again on a new connection, as a client would.
        seen = await _one(client, url, model, i, tokens)
    return seen


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, tokens: int) -> Seen:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt(i)}],
        "stream_options": {"include_usage": True},
    }
    seen = Seen(time.perf_counter())
    usage: int | None = None
    try:
        async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                seen.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return seen
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        seen.first = seen.first or now
                        seen.last = now
                        seen.chunks += 1
    except httpx.HTTPError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    seen.tokens = usage if usage is not None else seen.chunks
    return seen


@dataclass
class Level:
    contender: str
    concurrency: int
    wall_s: float
    seen: list[Seen] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return sum(s.tokens for s in self.seen) / self.wall_s if self.wall_s else 0.0

    def pct(self, what: str, q: float) -> float:
        values: list[float] = sorted(v for s in self.seen if (v := getattr(s, what)) is not None)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    @property
    def errors(self) -> list[str]:
        return [s.error for s in self.seen if s.error]


async def turn(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]]
) -> tuple[float, str]:
    """A streamed chat's TTFT (seconds) and its whole text (16 tokens); asked again once on a
    connection closed before any answer (llama-server's, as in ``one``)."""
    try:
        return await _turn(client, url, model, messages)
    except httpx.RemoteProtocolError:
        return await _turn(client, url, model, messages)


async def _turn(
    client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]]
) -> tuple[float, str]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": 16,
        "temperature": 0,
        "messages": messages,
    }
    sent, first, text = time.perf_counter(), None, ""
    async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                if piece := (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text += piece
    return (first or time.perf_counter()) - sent, text


async def second_turn(url: str, model: str) -> tuple[float, float]:
    """TTFT of a long conversation's first turn, and of its second (the first's prompt and
    answer, and a short question): what a prompt cache saves."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        first_msgs = [{"role": "user", "content": f"{LONG_TURN}\nWhat did the diary say?"}]
        first, answer = await turn(client, url, model, first_msgs)
        second_msgs = [
            *first_msgs,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And on the last day?"},
        ]
        second, _ = await turn(client, url, model, second_msgs)
    return first, second


async def level(url: str, model: str, name: str, c: int, per_client: int, tokens: int) -> Level:
    limits = httpx.Limits(max_connections=c * 2, max_keepalive_connections=c * 2)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        await one(client, url, model, 10_000, 8)  # warm: connections, caches, lazy imports
        seen: list[Seen] = []

        async def user(k: int) -> None:
            for j in range(per_client):
                seen.append(await one(client, url, model, k * per_client + j, tokens))

        started = time.perf_counter()
        await asyncio.gather(*(user(k) for k in range(c)))
        wall = time.perf_counter() - started
    return Level(name, c, wall, seen)


# --- contenders ------------------------------------------------------------------------------


def llama_cpp_server_argv(
    binary: Path, path: Path, chat_format: str | None, port: int, threads: int, slots: int
) -> list[str]:
    argv = [
        str(binary),
        "-m",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(N_CTX * slots),
        "--parallel",
        str(slots),
        "--cont-batching",
        "--no-webui",
    ]
    # --no-jinja: with Jinja on (llama-server's default) a --chat-template name is taken as a
    # template's text, and Gemma's prompts came out as the 3 tokens of "gemma".
    return argv + (["--no-jinja", "--chat-template", chat_format] if chat_format else [])


async def add_replica(url: str, model_id: str, proc: Proc) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{url}/instances", json={"model": model_id, "queue": True})
        r.raise_for_status()

        async def two() -> bool:
            return await serving_replicas(client, url, model_id) >= 2

        await proc.wait_for(two, "two ready replicas", READY_TIMEOUT)


async def run_contender(
    name: str,
    proc: Proc,
    url: str,
    ready_url: str | None,
    model: str,
    levels: list[int],
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    replica: tuple[str, str] | None = None,
    turns: dict[str, tuple[float, float]] | None = None,
) -> list[Level]:
    print(f"  {name} ...", file=sys.stderr, flush=True)
    proc.start(env)
    try:
        if ready_url is None:
            await wait_shoal_ready(proc)
        else:
            await wait_http(proc, ready_url, "health")
        if replica is not None:
            await add_replica(replica[0], replica[1], proc)
        out = []
        for c in levels:
            per_client = max(args.per_client, -(-MIN_REQUESTS // c))
            out.append(await level(url, model, name, c, per_client, args.tokens))
        if turns is not None:
            turns[name] = await second_turn(url, model)
        return out
    finally:
        await proc.astop(signal.SIGINT, 30.0)


# --- report ----------------------------------------------------------------------------------

ANCHOR, PYTHON, SHOAL, SHOAL2 = "llama-server", "llama_cpp.server", "shoal up", "shoal up x2"


def turns_table(model_id: str, turns: dict[str, tuple[float, float]]) -> bool:
    """The prompt cache: a 1,500-token conversation's second turn against its first."""
    ok = True
    for name, (first, second) in turns.items():
        sooner = first / second if second else float("nan")
        print(
            f"prompt cache, {name}: first turn TTFT {first * 1000:.0f} ms, second"
            f" {second * 1000:.0f} ms: {sooner:.1f}x sooner"
        )
        if name == SHOAL:
            ok = sooner >= 5
            print(f"{verdict(ok)} {model_id}: second turn {sooner:.1f}x sooner (target >= 5x)")
    return ok


def table(model_id: str, results: dict[str, list[Level]]) -> bool:
    anchor = {lv.concurrency: lv for lv in results.get(ANCHOR, [])}
    print(f"\n## {model_id}\n")
    print(
        "| contender | c | tokens/s | x anchor | TTFT p50 | p95 | x anchor p50 | ITL p50 | p95 |"
        " errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, lvs in results.items():
        for lv in lvs:
            a = anchor.get(lv.concurrency)
            r_tps = lv.tps / a.tps if a and a.tps else float("nan")
            r_ttft = lv.pct("ttft", 0.5) / a.pct("ttft", 0.5) if a else float("nan")
            print(
                f"| {name} | {lv.concurrency} | {lv.tps:.1f} | {r_tps:.2f}x |"
                f" {lv.pct('ttft', 0.5) * 1000:.0f} ms | {lv.pct('ttft', 0.95) * 1000:.0f} ms |"
                f" {r_ttft:.2f}x | {lv.pct('itl', 0.5) * 1000:.1f} ms |"
                f" {lv.pct('itl', 0.95) * 1000:.1f} ms | {len(lv.errors)} |"
            )
    ok = True
    shoal = {lv.concurrency: lv for lv in results.get(SHOAL, [])}
    for c, a in anchor.items():
        s = shoal.get(c)
        if s is None or not a.tps:
            continue
        ratio = s.tps / a.tps
        want = 0.97 if c == 1 else 0.9 if c >= 8 else None
        if want is not None:
            good = ratio >= want
            ok &= good
            print(
                f"{verdict(good)} {model_id} c={c}: tokens/s {ratio:.2f}x"
                f" llama-server (target >= {want}x)"
            )
        if c == 8:
            t = s.pct("ttft", 0.5) / a.pct("ttft", 0.5)
            ok &= t <= 1.25
            print(
                f"{verdict(t <= 1.25)} {model_id} c=8: TTFT p50 {t:.2f}x"
                " llama-server (target <= 1.25x)"
            )
    for name, lvs in results.items():
        for lv in lvs:
            if lv.errors:
                ok = False
                print(
                    f"FAIL {name} c={lv.concurrency}: {len(lv.errors)} errors, e.g. {lv.errors[0]}"
                )
    return ok


async def bench_model(model_id: str, args: argparse.Namespace, tmp: Path, binary: Path) -> bool:
    path = gguf(model_id, tmp)
    chat_format = card_for(model_id).chat_format
    levels = args.levels
    results: dict[str, list[Level]] = {}
    turns: dict[str, tuple[float, float]] = {}
    print(f"{model_id}: {path.name}", file=sys.stderr)
    port = free_port("127.0.0.1")
    argv = llama_cpp_server_argv(binary, path, chat_format, port, args.threads, args.slots)
    proc = Proc(ANCHOR, argv, tmp / f"{model_id}-anchor.log")
    url = f"http://127.0.0.1:{port}"
    results[ANCHOR] = await run_contender(
        ANCHOR, proc, f"{url}/v1", f"{url}/health", model_id, levels, args, turns=turns
    )
    if args.llama_cpp_python:
        port = free_port("127.0.0.1")
        argv = python_server_argv(path, model_id, port, args.threads, N_CTX, chat_format)
        proc = Proc(PYTHON, argv, tmp / f"{model_id}-python.log")
        url = f"http://127.0.0.1:{port}"
        results[PYTHON] = await run_contender(
            PYTHON, proc, f"{url}/v1", f"{url}/v1/models", model_id, levels, args
        )
    env = shoal_env()
    port = free_port("127.0.0.1")
    argv = shoal_up_argv(tmp / f"up-{model_id}-1", model_id, port, args.threads, args.slots)
    proc = Proc(SHOAL, argv, tmp / f"{model_id}-shoal.log")
    url = f"http://127.0.0.1:{port}/v1"
    results[SHOAL] = await run_contender(
        SHOAL, proc, url, None, model_id, levels, args, env, turns=turns
    )
    if args.two_replicas and args.threads >= 2:
        port = free_port("127.0.0.1")
        half = args.threads // 2
        argv = shoal_up_argv(tmp / f"up-{model_id}-2", model_id, port, half, args.slots)
        proc = Proc(SHOAL2, argv, tmp / f"{model_id}-shoal2.log")
        url = f"http://127.0.0.1:{port}/v1"
        results[SHOAL2] = await run_contender(
            SHOAL2, proc, url, None, model_id, levels[-2:], args, env, replica=(url, model_id)
        )
    ok = table(model_id, results)
    return turns_table(model_id, turns) and ok


async def run(args: argparse.Namespace) -> int:
    binary = llama_server()
    print(
        f"# Concurrency: {args.tokens}-token greedy streams, {args.threads} threads,"
        f" {args.slots} slots, {args.per_client} requests per client; load average"
        f" {os.getloadavg()[0]:.2f}"
    )
    ok = True
    with tempfile.TemporaryDirectory(prefix="shoal-concurrency-") as d:
        for model_id in args.models:
            ok &= await bench_model(model_id, args, Path(d), binary)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", type=lambda s: s.split(","), default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--no-llama-cpp-python", dest="llama_cpp_python", action="store_false")
    p.add_argument("--no-two-replicas", dest="two_replicas", action="store_false")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
