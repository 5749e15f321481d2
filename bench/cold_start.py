"""Cold starts, side by side in one run: llama.cpp's ``llama-server`` in router mode
(``--models-dir`` with two GGUF files, ``--models-max 1``) and ``shoal up --no-model
--max-loaded 1`` with the same two models added, the same files and threads.

For each: the time to the first token of a request for a cold model (nothing loaded), of a warm
one (loaded), and of requests alternating between the two models with room for one (each
evicting the other), medians of ``--rounds``. Targets (issue 34): Shoal's cold and alternating
first tokens <= 1.25x llama-server's; warm as before. Shoal's cold start is broken down from
its log: placement (InstanceRequested to InstancePlaced), runner start (to Loading), load (to
Ready), then the first token.

    .venv/bin/python -m bench.cold_start
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common.llama_server import llama_server
from bench.common.processes import (
    add_model,
    gguf,
    nats_url_of,
    shoal_env,
    shoal_up_argv,
    wait_http,
    wait_shoal_ready,
)
from bench.common.report import verdict
from bus.connection import connect
from bus.embedded import free_port
from bus.streams import EVENTS_STREAM
from events.catalogue import (
    InstancePlaced,
    InstanceRequested,
    RunnerStateChanged,
    TaskCreated,
    TaskStarted,
    parse_event,
)
from events.subjects import aggregate_filter
from harness.processes import Proc

MODELS = ("smollm2-135m", "gemma3-270m")
PROMPT = "The capital of France is"
ANCHOR, SHOAL = "llama-server (router)", "shoal up"
CONTEXT = 2048  # llama-server's -c


@dataclass
class Timings:
    cold: float = 0.0
    cold_sent_at: float = 0.0  # the wall clock when the cold request was sent
    warm: list[float] = field(default_factory=list)
    alternating: list[float] = field(default_factory=list)


async def first_token(client: httpx.AsyncClient, url: str, model: str) -> float:
    """Seconds until the first streamed token of a one-token completion."""
    started = time.monotonic()
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "stream": True, "temperature": 0}
    async with client.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "choices" not in json.loads(line.removeprefix("data: ")):
                    raise RuntimeError(f"{model}: {line}")  # an error, not a token
                return time.monotonic() - started
    raise RuntimeError(f"{model}: no token")


async def measure(url: str, names: tuple[str, str], rounds: int) -> Timings:
    a, b = names
    t = Timings()
    async with httpx.AsyncClient(timeout=600) as client:
        t.cold_sent_at = time.time()
        t.cold = await first_token(client, url, a)
        for _ in range(rounds):
            t.warm.append(await first_token(client, url, a))
        for i in range(rounds * 2):
            t.alternating.append(await first_token(client, url, b if i % 2 == 0 else a))
    return t


async def anchor(
    binary: Path, files: dict[str, Path], threads: int, rounds: int, tmp: Path
) -> Timings:
    models = tmp / "router-models"
    models.mkdir()
    for name, path in files.items():
        (models / f"{name}.gguf").symlink_to(path)
    port = free_port("127.0.0.1")
    argv = [
        str(binary),
        "--models-dir",
        str(models),
        "--models-max",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-c",
        str(CONTEXT),
        "--no-webui",
    ]
    proc = Proc(ANCHOR, argv, tmp / "router.log")
    proc.start()
    try:
        await wait_http(proc, f"http://127.0.0.1:{port}/health", "health")
        return await measure(f"http://127.0.0.1:{port}/v1", MODELS, rounds)
    finally:
        await proc.astop()


async def shoal(
    threads: int, rounds: int, tmp: Path, context: int | None
) -> tuple[Timings, dict[str, float]]:
    port = free_port("127.0.0.1")
    data = tmp / "up"
    argv = [*shoal_up_argv(data, None, port, threads), "--max-loaded", "1"]
    if context:
        # The KV cache llama-server's router gives its models (-c: all its slots together),
        # through Shoal's per-model defaults and one slot: llama.cpp allocates and clears a
        # context's whole KV cache when it makes it, most of a small model's load.
        defaults = tmp / "model-defaults.json"
        defaults.write_text(json.dumps({m: {"context_length": context} for m in MODELS}))
        argv += ["--model-defaults", str(defaults), "--slots", "1"]
    proc = Proc(SHOAL, argv, tmp / "up.log")
    proc.start(shoal_env())
    try:
        await wait_shoal_ready(proc)
        nats_url = nats_url_of(proc)
        for model in MODELS:  # added beforehand, as llama-server's directory holds them
            await add_model(proc, data, model)
        timings = await measure(f"http://127.0.0.1:{port}/v1", MODELS, rounds)
        return timings, await breakdown(nats_url, timings.cold_sent_at)
    finally:
        await proc.astop()


async def breakdown(nats_url: str, since: float) -> dict[str, float]:
    """The first on-demand instance's steps, in seconds from the request sent at ``since``
    (from the log)."""
    nc = await connect(nats_url, name="bench-cold-start")
    try:
        js = nc.jetstream()
        info = await js.stream_info(EVENTS_STREAM)
        steps: dict[str, float] = {}
        for aggregate in ("instance", "runner", "task"):
            sub = await js.subscribe(aggregate_filter(aggregate), ordered_consumer=True)
            seq = 0
            while seq < info.state.last_seq:
                try:
                    msg = await sub.next_msg(timeout=2)
                except TimeoutError:
                    break
                seq = msg.metadata.sequence.stream
                event = parse_event(msg.data)
                at = event.ts.timestamp()
                if at < since:
                    continue
                if isinstance(event, InstanceRequested):
                    steps.setdefault("requested", at)
                elif isinstance(event, InstancePlaced):
                    steps.setdefault("placed", at)
                elif isinstance(event, RunnerStateChanged) and event.state in ("Loading", "Ready"):
                    steps.setdefault(event.state.lower(), at)
                elif isinstance(event, TaskCreated):
                    steps.setdefault("task created", at)
                elif isinstance(event, TaskStarted):
                    steps.setdefault("task started", at)
            await sub.unsubscribe()
        return {k: v - since for k, v in steps.items()}
    finally:
        await nc.close()


def ratio(shoal_s: float, anchor_s: float) -> str:
    return f"{shoal_s / anchor_s:.2f}x" if anchor_s else "-"


def report(a: Timings, s: Timings, steps: dict[str, float]) -> bool:
    rows = [
        ("cold (nothing loaded)", a.cold, s.cold, 1.25),
        ("warm", statistics.median(a.warm), statistics.median(s.warm), None),
        (
            "alternating (room for one)",
            statistics.median(a.alternating),
            statistics.median(s.alternating),
            1.25,
        ),
    ]
    print(f"| first token, s | {ANCHOR} | {SHOAL} | ratio | target |")
    print("|---|---|---|---|---|")
    ok = True
    for what, anchor_s, shoal_s, target in rows:
        met = target is None or shoal_s <= target * anchor_s
        ok &= met
        want = f"<= {target}x" if target else ""
        print(
            f"| {what} | {anchor_s:.3f} | {shoal_s:.3f} | {ratio(shoal_s, anchor_s)} | {want}"
            f"{f' {verdict(met)}' if target else ''} |"
        )
    shown = ", ".join(f"{k} at {v:.2f} s" for k, v in sorted(steps.items(), key=lambda kv: kv[1]))
    print(
        f"\nShoal's first cold start, from the request's sending: {shown};"
        f" first token at {s.cold:.2f} s"
    )
    return ok


async def run(args: argparse.Namespace) -> int:
    binary = llama_server()
    with tempfile.TemporaryDirectory(prefix="shoal-cold-start-") as d:
        tmp = Path(d)
        files = {m: gguf(m, tmp) for m in MODELS}
        print(
            f"# Cold starts: {', '.join(MODELS)}, {args.threads} threads, {args.rounds} rounds",
            file=sys.stderr,
        )
        a = await anchor(binary, files, args.threads, args.rounds, tmp)
        s, steps = await shoal(args.threads, args.rounds, tmp, args.same_context)
    return 0 if report(a, s, steps) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    parser.add_argument("--rounds", type=int, default=3, help="warm and alternating requests")
    parser.add_argument(
        "--same-context",
        type=int,
        nargs="?",
        const=CONTEXT,
        default=None,
        help="give Shoal's on-demand instances llama-server's KV cache: its context"
        f" (--model-defaults) in one slot [{CONTEXT}]; without it, each model's context and"
        " slots are what placement gives it",
    )
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
