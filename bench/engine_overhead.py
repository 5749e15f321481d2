"""Engine overhead: a Shoal runner against llama-cpp-python in-process, side by side.

    .venv/bin/python -m bench.engine_overhead [--model smollm2|gemma] [--tokens 256]
                                               [--prompts 4] [--repeat 3]

It starts its own nats-server (never the one on 4222) in a temporary directory, then a real
runner process (``shoal runner --spec ...``, as a worker starts it), waits for it to report
Ready, and loads the same GGUF in this process with the same ``LlamaCppEngine`` (same
``n_ctx``, same ``n_threads``: the runner takes ``os.cpu_count()``, so this does too).

Every prompt is a plain completion, greedy (temperature 0), ``--tokens`` tokens. Each prompt is
run once through the runner and once in-process, one after the other and never at the same
time (the machine may have few cores); a warm-up pair with another prompt comes first and is
not counted. The sides strictly alternate (runner, in-process, runner, ...), so every measured
run follows a run of the other side: a side that runs twice in a row starts warm and gets its
first token sooner, by more than the TTFT difference being measured.

- runner, as a client sees it: ``TaskCreated`` is published to JetStream and its ack awaited;
  the chunks on ``shoal.chunks.<task_id>`` are timestamped on arrival (core NATS subscription,
  set up before the publish). TTFT is from the ack to the first chunk carrying a token (also
  shown: from before the publish, i.e. including its round trip); tokens/s is
  ``(n - 1) / (last token's arrival - first token's arrival)``. The runner's own figures from
  ``TaskCompleted`` are shown beside them.
- in-process: the prompt is tokenized by the engine (``prepare``, as the runner does),
  then the clock starts and ``engine.generate`` (the runner's sampling settings) is iterated for
  ``--tokens`` tokens. TTFT is to the first token; tokens/s as above.

Both sides must produce the same tokens (greedy); a mismatch, or a prompt that ends before
``--tokens`` tokens, is flagged. Per prompt the median over the repeats is shown, and overall the
median over all pairs of the ratio (runner / in-process tokens/s; target >= 0.97x) and of the
TTFT difference (runner - in-process; target <= 10 ms). The exit status is 1 when a target is
missed.

Two diagnostics come with the figures. "other" is how many cores other processes used during
each run (from /proc): on a shared machine a busy neighbour slows whichever side it overlaps,
so the medians are also given over the undisturbed pairs alone. And the CPU the nats-server and
this client spend per runner token: with llama.cpp keeping every core busy, that time is taken
from its threads, which is where most of the runner's tokens/s gap goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bench.common import procfs
from bench.common.procfs import QUIET
from bench.common.report import med, print_head, verdict
from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.streams import ensure_streams
from events.catalogue import (
    ChunkGenerated,
    RunnerStateChanged,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    parse_event,
)
from events.records import SamplingParams, ShardAssignment, Timings
from events.subjects import aggregate_filter
from inference.decoding import PromptCached, Token
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.job import prepare
from services.models.catalogue import card_for
from services.models.metadata import read_gguf
from services.models.resolve import resolve_model
from services.runner import RunnerSpec
from services.worker.supervisor import start_runner

TPS_TARGET = 0.97  # runner tokens/s at least this fraction of in-process
TTFT_TARGET_MS = 10.0  # at most this much added to the time to the first token

MODELS = {"smollm2": "smollm2-135m", "gemma": "gemma3-270m"}

# Prompts that both built-in models continue for at least 256 tokens under greedy decoding
# (checked: none reaches an end token before that).
PROMPTS = (
    "The history of the Roman Empire",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
)
WARMUP_PROMPT = "The three laws of thermodynamics are"

READY_TIMEOUT = 180.0  # seconds for the runner to load the model
TASK_TIMEOUT = 300.0  # seconds for one task to complete


# --- how busy the rest of the machine was ------------------------------------------------------


def nats_server_pid() -> int:
    """The embedded nats-server this process started (0 if it cannot be told)."""
    for pid in procfs.descendants(os.getpid()):
        if procfs.named(pid) == "nats-server":
            return pid
    return 0


def other_load() -> procfs.CpuWatch:
    """How many cores other processes use (``other_cores()``) over a stretch of the benchmark:
    other engineers' work steals cycles from llama.cpp's threads, and is the main source of
    noise on a small machine. This process and its children (the nats-server, the runner) are
    the bench's own."""
    return procfs.CpuWatch(lambda: {"own": procfs.tree_ticks(os.getpid())})


@dataclass(frozen=True)
class Side:
    """One generation, on one side, with client-side timings in seconds."""

    tokens: list[int]
    ended: bool  # stopped at an end token (or the runner said "stop") before the limit
    ttft: float  # runner: from the publish ack; in-process: from the start of generate
    tps: float  # decode tokens/s: (n - 1) / (last - first)
    other: float = 0.0  # cores used by other processes meanwhile
    # runner only: CPU seconds per token spent by the nats-server and by this client
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    # runner only
    ack: float = 0.0  # publish round trip (TaskCreated stored)
    reported: Timings | None = None
    finish: str = ""

    @property
    def ttft_from_publish(self) -> float:
        return self.ttft + self.ack


@dataclass(frozen=True)
class Pair:
    prompt: int  # index into the prompts
    repeat: int
    inproc: Side
    runner: Side

    @property
    def ratio(self) -> float:
        return self.runner.tps / self.inproc.tps if self.inproc.tps > 0 else 0.0

    @property
    def added_ms(self) -> float:
        return (self.runner.ttft - self.inproc.ttft) * 1000

    @property
    def added_from_publish_ms(self) -> float:
        return (self.runner.ttft_from_publish - self.inproc.ttft) * 1000

    @property
    def quiet(self) -> bool:
        return max(self.inproc.other, self.runner.other) < QUIET

    @property
    def same_tokens(self) -> bool:
        return self.inproc.tokens == self.runner.tokens


def decode_tps(times: list[float]) -> float:
    """Tokens/s between the first and the last token: ``(n - 1) / (t_last - t_first)``."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])


def completion(model_id: str, prompt: str, tokens: int) -> TaskCreated:
    return TaskCreated(
        task_id=f"bench-{uuid.uuid4().hex[:12]}",
        model_id=model_id,
        origin="bench",
        kind="completion",
        prompt=prompt,
        params=SamplingParams(max_tokens=tokens, temperature=0.0, seed=0),
    )


# --- in-process --------------------------------------------------------------------------------


def run_inprocess(engine: LlamaCppEngine, task: TaskCreated, limit: int) -> Side:
    job = prepare(engine, task)  # as the runner does; not timed (microseconds)
    tokens: list[int] = []
    times: list[float] = []
    ended = False
    clock = time.perf_counter
    load = other_load()
    start = clock()
    for item in engine.generate(job.prompt, job.decoding):
        now = clock()
        if isinstance(item, PromptCached):  # the prompt's tokens its slot held already
            continue
        assert isinstance(item, Token)
        token = item.id
        if engine.is_end(token):
            ended = True
            break
        tokens.append(token)
        times.append(now)
        if len(tokens) >= limit:
            break
    ttft = (times[0] - start) if times else 0.0
    other = load.other_cores()
    return Side(tokens=tokens, ended=ended, ttft=ttft, tps=decode_tps(times), other=other)


# --- runner --------------------------------------------------------------------------------------


@dataclass
class Inbox:
    """A core NATS subscription whose messages are timestamped on arrival and parsed later,
    so that the bench does as little as possible while the runner generates."""

    received: list[tuple[float, bytes]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    until: Callable[[bytes], bool] = lambda _data: False
    sub: Subscription | None = None

    async def on_msg(self, msg: Msg) -> None:
        self.received.append((time.perf_counter(), msg.data))
        if self.until(msg.data):
            self.done.set()

    async def start(self, nc: Client, subject: str) -> Inbox:
        self.sub = await nc.subscribe(subject, cb=self.on_msg)
        return self

    async def stop(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
            self.sub = None


def _is_outcome(data: bytes) -> bool:
    return b'"TaskCompleted"' in data or b'"TaskFailed"' in data


async def run_on_runner(
    nc: Client, publisher: Publisher, task: TaskCreated, limit: int, server_pid: int = 0
) -> Side:
    chunks = await Inbox().start(nc, ChunkGenerated.subject_for(task.task_id))
    task_events = aggregate_filter("task", task.model_id, task.task_id)
    outcome = await Inbox(until=_is_outcome).start(nc, task_events)
    await nc.flush()  # the subscriptions are on the server before the task is
    try:
        load = other_load()
        server0, client0 = procfs.process_ticks(server_pid), procfs.process_ticks(os.getpid())
        published = time.perf_counter()
        await publisher.publish(task)
        acked = time.perf_counter()
        await asyncio.wait_for(outcome.done.wait(), TASK_TIMEOUT)
        other = load.other_cores()
        server = procfs.process_ticks(server_pid) - server0 if server_pid else 0
        client = procfs.process_ticks(os.getpid()) - client0
        await nc.flush()  # every chunk published before the outcome has arrived
    finally:
        await chunks.stop()
        await outcome.stop()

    final = parse_event(outcome.received[-1][1])
    if isinstance(final, TaskFailed):
        raise RuntimeError(f"the runner failed task {task.task_id}: {final.error}")
    assert isinstance(final, TaskCompleted)
    tokens: list[int] = []
    times: list[float] = []
    finish = final.finish_reason
    parsed: list[tuple[float, ChunkGenerated]] = []
    for at, data in chunks.received:
        event = parse_event(data)
        assert isinstance(event, ChunkGenerated)
        parsed.append((at, event))
    parsed.sort(key=lambda p: p[1].idx)
    if [c.idx for _, c in parsed] != list(range(len(parsed))):
        raise RuntimeError(f"task {task.task_id}: chunks missing or out of order")
    for at, chunk in parsed:
        if chunk.token_id is not None:
            tokens.append(chunk.token_id)
            times.append(at)
    if final.usage.completion_tokens != len(tokens):
        raise RuntimeError(
            f"task {task.task_id}: {len(tokens)} token chunks, "
            f"TaskCompleted says {final.usage.completion_tokens}"
        )
    return Side(
        tokens=tokens,
        ended=finish != "length" or len(tokens) < limit,
        ttft=(times[0] - acked) if times else 0.0,
        tps=decode_tps(times),
        other=other,
        server_cpu=server / procfs.HZ / max(1, len(tokens)),
        client_cpu=client / procfs.HZ / max(1, len(tokens)),
        ack=acked - published,
        reported=final.timings,
        finish=finish,
    )


class Runner:
    """A runner process started as a worker starts it, watched until it is Ready."""

    def __init__(self, spec: RunnerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, nc: Client) -> None:
        def ready_or_failed(data: bytes) -> bool:
            return b'"Ready"' in data or b'"Failed"' in data

        states = await Inbox(until=ready_or_failed).start(
            nc, RunnerStateChanged.subject_for(self.spec.runner_id)
        )
        await nc.flush()
        with self.log_path.open("wb") as log_file:
            self.proc = await start_runner(self.spec, log_file)
        exited = asyncio.create_task(self.proc.wait())
        ready = asyncio.create_task(states.done.wait())
        try:
            await asyncio.wait(
                {exited, ready}, timeout=READY_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            exited.cancel()
            ready.cancel()
            await states.stop()
        last = parse_event(states.received[-1][1]) if states.received else None
        if not isinstance(last, RunnerStateChanged) or last.state != "Ready":
            reason = last.error if isinstance(last, RunnerStateChanged) else "no state reported"
            raise RuntimeError(f"the runner did not become Ready ({reason}):\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


# --- report --------------------------------------------------------------------------------------


def short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def notes(pair: Pair, limit: int) -> str:
    out = []
    if not pair.same_tokens:
        out.append("tokens differ")
    if pair.inproc.ended or len(pair.inproc.tokens) < limit:
        out.append(f"in-process ended at {len(pair.inproc.tokens)}")
    if pair.runner.ended:
        out.append(f"runner {pair.runner.finish} at {len(pair.runner.tokens)}")
    return "; ".join(out)


def summary(label: str, pairs: list[Pair]) -> bool:
    """The medians over ``pairs`` against the targets; True when both are met."""
    ratio = med(p.ratio for p in pairs)
    added = med(p.added_ms for p in pairs)
    added_pub = med(p.added_from_publish_ms for p in pairs)
    ok_tps, ok_ttft = ratio >= TPS_TARGET, added <= TTFT_TARGET_MS
    print()
    print(f"{label} (median over {len(pairs)} pairs)")
    print(
        f"  tokens/s  in-process {med(p.inproc.tps for p in pairs):6.1f}    "
        f"runner {med(p.runner.tps for p in pairs):6.1f}    "
        f"ratio {ratio:.3f}x   (target >= {TPS_TARGET:.2f}x)  {verdict(ok_tps)}"
    )
    print(
        f"  TTFT      in-process {med(p.inproc.ttft for p in pairs) * 1000:6.1f} ms "
        f"runner {med(p.runner.ttft for p in pairs) * 1000:6.1f} ms "
        f"added {added:+.1f} ms  (target <= {TTFT_TARGET_MS:.0f} ms)  {verdict(ok_ttft)}"
    )
    print(
        f"            with the TaskCreated publish round trip "
        f"(ack {med(p.runner.ack for p in pairs) * 1000:.1f} ms): "
        f"added {added_pub:+.1f} ms  {verdict(added_pub <= TTFT_TARGET_MS)}"
    )
    token_ms = 1000 / med(p.inproc.tps for p in pairs)
    print(
        f"  CPU per runner token spent outside the runner: nats-server "
        f"{med(p.runner.server_cpu for p in pairs) * 1000:.2f} ms, this client "
        f"{med(p.runner.client_cpu for p in pairs) * 1000:.2f} ms"
    )
    print(f"            (an in-process token takes {token_ms:.2f} ms with every core busy)")
    return ok_tps and ok_ttft


def report(pairs: list[Pair], prompts: list[str], limit: int) -> bool:
    print()
    print("every pair: in-process TTFT from generate(), runner TTFT from the publish ack;")
    print("other = cores used by other processes during the in-process / runner run")
    head = (
        f"{'#':>2} {'rep':>3} {'n':>4} | {'in-proc':>7} {'tok/s':>6} | "
        f"{'ack':>4} {'runner':>7} {'tok/s':>6} | {'dTTFT':>6} {'ratio':>6} | "
        f"{'reported':>8} {'tok/s':>6} | {'other':>9}"
    )
    under = (
        f"{'':>2} {'':>3} {'':>4} | {'TTFT ms':>7} {'':>6} | "
        f"{'ms':>4} {'TTFT ms':>7} {'':>6} | {'ms':>6} {'':>6} | {'TTFT ms':>8} {'':>6} | "
        f"{'':>9}"
    )
    print_head(head, under)
    for p in pairs:
        rep = p.runner.reported
        line = (
            f"{p.prompt + 1:>2} {p.repeat + 1:>3} {len(p.runner.tokens):>4} | "
            f"{p.inproc.ttft * 1000:>7.1f} {p.inproc.tps:>6.1f} | "
            f"{p.runner.ack * 1000:>4.1f} {p.runner.ttft * 1000:>7.1f} {p.runner.tps:>6.1f} | "
            f"{p.added_ms:>+6.1f} {p.ratio:>5.3f}x | "
            f"{(rep.ttft_ms if rep else 0.0):>8.1f} {(rep.tokens_per_s if rep else 0.0):>6.1f} | "
            f"{p.inproc.other:>4.2f}/{p.runner.other:<4.2f}"
        )
        extra = notes(p, limit)
        print(line + (f"  ! {extra}" if extra else ""))

    print()
    print("per prompt (median over repeats)")
    head = (
        f"{'#':>2} {'prompt':<40} | {'in-proc':>7} {'runner':>7} {'dTTFT':>6} | "
        f"{'in-proc':>7} {'runner':>7} {'ratio':>6} | {'TTFT':>4} {'tok/s':>5}"
    )
    under = (
        f"{'':>2} {'':<40} | {'TTFT ms':>7} {'TTFT ms':>7} {'ms':>6} | "
        f"{'tok/s':>7} {'tok/s':>7} {'':>6} | {'':>4} {'':>5}"
    )
    print_head(head, under)
    for i, prompt in enumerate(prompts):
        mine = [p for p in pairs if p.prompt == i]
        added = med(p.added_ms for p in mine)
        ratio = med(p.ratio for p in mine)
        print(
            f"{i + 1:>2} {short(repr(prompt), 40):<40} | "
            f"{med(p.inproc.ttft for p in mine) * 1000:>7.1f} "
            f"{med(p.runner.ttft for p in mine) * 1000:>7.1f} {added:>+6.1f} | "
            f"{med(p.inproc.tps for p in mine):>7.1f} {med(p.runner.tps for p in mine):>7.1f} "
            f"{ratio:>5.3f}x | {verdict(added <= TTFT_TARGET_MS):>4} "
            f"{verdict(ratio >= TPS_TARGET):>5}"
        )

    ok = summary("overall", pairs)
    quiet = [p for p in pairs if p.quiet]
    if quiet and len(quiet) < len(pairs):
        summary(f"undisturbed pairs only (other processes < {QUIET} cores on both sides)", quiet)
    elif not quiet:
        print(f"\n(no pair ran undisturbed: other processes used >= {QUIET} cores in every one)")
    mismatched = sum(not p.same_tokens for p in pairs)
    short_runs = sum(bool(p.inproc.ended or p.runner.ended) for p in pairs)
    print()
    print(
        f"tokens: {'identical on both sides' if not mismatched else f'{mismatched} pairs differ'}"
        f"; {'every run reached the limit' if not short_runs else f'{short_runs} runs ended early'}"
    )
    return ok


# --- main ----------------------------------------------------------------------------------------


async def run(args: argparse.Namespace, tmp: Path) -> int:
    model_id = MODELS[args.model]
    card = card_for(model_id)
    model_path: Path = args.model_path
    n_layers = read_gguf(model_path).n_layers
    prompts = list(PROMPTS[: args.prompts])
    n_threads = os.cpu_count() or 1  # what LlamaCppEngine gives the runner

    with EmbeddedNats(tmp / "nats") as server:
        nc = await connect(server.url, name="shoal-bench-engine")
        runner: Runner | None = None
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            publisher = Publisher(js)
            spec = RunnerSpec(
                nats_url=server.url,
                node_id="bench-node",
                instance_id="bench-instance",
                model_id=model_id,
                shard=ShardAssignment(
                    runner_id="bench-runner",
                    node_id="bench-node",
                    start_layer=0,
                    end_layer=n_layers,
                    n_layers=n_layers,
                ),
                model_path=str(model_path),
                chat_format=card.chat_format,
                n_ctx=args.n_ctx,
                cache_dir=str(args.cache_dir),
            )
            server_pid = nats_server_pid()
            runner = Runner(spec, tmp / "runner.log")
            started = time.perf_counter()
            await runner.start(nc)
            runner_load = time.perf_counter() - started

            # Loaded after the runner, so that the two never compete for the cores.
            engine = LlamaCppEngine(
                model_path, n_ctx=args.n_ctx, chat_format=card.chat_format, n_threads=n_threads
            )
            engine.load()

            print(
                f"engine overhead: {model_id} ({model_path.name}), llama-cpp-python "
                f"{importlib.metadata.version('llama-cpp-python')}, n_threads={n_threads} on "
                f"{os.cpu_count()} cpus, n_ctx={args.n_ctx}"
            )
            print(
                f"greedy, {args.tokens} tokens, {len(prompts)} prompts x {args.repeat} repeats, "
                f"runner pid {runner.pid} (Ready in {runner_load:.1f} s), nats {server.url}"
            )

            async def pair(prompt_no: int, prompt: str, repeat: int) -> Pair:
                task = completion(model_id, prompt, args.tokens)
                on_runner = await run_on_runner(nc, publisher, task, args.tokens, server_pid)
                inproc = run_inprocess(engine, task, args.tokens)
                return Pair(prompt_no, repeat, inproc, on_runner)

            for _ in range(2):  # warm-up, not counted
                await pair(-1, WARMUP_PROMPT, 0)

            pairs: list[Pair] = []
            for repeat in range(args.repeat):
                for i, prompt in enumerate(prompts):
                    pairs.append(await pair(i, prompt, repeat))
            load = os.getloadavg()
            ok = report(pairs, prompts, args.tokens)
            print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
            return 0 if ok else 1
        except Exception:
            if runner is not None:
                sys.stderr.write(f"--- runner log\n{runner.log_tail()}\n")
            raise
        finally:
            if runner is not None:
                await runner.stop()
            await nc.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    parser.add_argument(
        "--prompts", type=int, default=4, help=f"how many prompts (1-{len(PROMPTS)})"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of every prompt per side")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context size on both sides")
    parser.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "shoal-bench"),
        help="where gemma3-270m is assembled (once)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    if args.tokens < 2 or args.repeat < 1:
        parser.error("--tokens must be at least 2 and --repeat at least 1")
    args.cache_dir = Path(args.cache_dir).expanduser()
    # gemma3-270m is assembled from its chunk packages on first use, before any clock starts.
    args.model_path = resolve_model(card_for(MODELS[args.model]), args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-engine-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
