"""The figures of ``bench.api_overhead`` and its report: each run's record, the triples (one
prompt, one repeat, every contender), the first-token rounds, the concurrent bursts, and the
tables and medians printed of them, against the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.common.chat import Stream
from bench.common.procfs import QUIET
from bench.common.report import iqr, med, print_head, verdict

TPS_TARGET = 0.97  # Shoal tokens/s at least this fraction of in-process
TPS_SERVER_TARGET = 1.0  # ... and at least llama_cpp.server's
TTFT_TARGET_MS = 10.0  # at most this much added to in-process time to the first token

INPROC, SERVER, SHOAL = "in-process", "llama_cpp.server", "shoal up"


@dataclass(frozen=True)
class Trace:
    """Where a Shoal request's first token went, in ms: the events' own ``ts`` (when the API or
    the runner made them) and the nats-server's time of storing them, against the client's
    clock (one machine, one clock)."""

    api: float  # request sent -> TaskCreated made (HTTP, FastAPI's routing, request body)
    publish: float  # -> TaskCreated stored (cluster state read, response start, subscribe, publish)
    pull: float  # -> TaskStarted made by the runner (delivery to its pull request, task ack)
    generate: float  # -> first ChunkGenerated made (TaskStarted, state Running, prefill, 1 token)
    chunk_store: float  # -> first ChunkGenerated stored
    deliver: float  # -> its text at the client (NATS to the API, SSE, HTTP)
    runner_ttft: float  # the runner's own figure (task received -> first token)

    STEPS = (
        ("api", "request sent -> TaskCreated made (HTTP, FastAPI's routing, request body)"),
        ("publish", "-> TaskCreated stored (cluster state from the DB, response start, publish)"),
        ("pull", "-> TaskStarted made by the runner (delivery of its pull, task ack)"),
        ("generate", "-> first ChunkGenerated made (TaskStarted + Running, prefill, 1 token)"),
        ("chunk_store", "-> first ChunkGenerated stored in JetStream"),
        ("deliver", "-> its text at the client (NATS to the API, parse, SSE, HTTP)"),
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


# --- tables --------------------------------------------------------------------------------------


def runs_table(triples: list[Triple], limit: int) -> None:
    print()
    print("every triple: TTFT ms / tokens/s per contender; ratios of Shoal's tokens/s; dTTFT =")
    print("Shoal - in-process; other = cores used by other processes (max over the three runs)")
    head = (
        f"{'#':>2} {'rep':>3} | {'in-process':>12} | {'llama_cpp.srv':>13} | {'shoal up':>12} | "
        f"{'/inproc':>7} {'/server':>7} {'dTTFT':>6} | {'other':>5}"
    )
    print_head(head)
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
        rel = (
            ""
            if name == INPROC
            else (
                f"{med(_ratio(t.runs[name].tps, t.runs[INPROC].tps) for t in triples):.3f}x, "
                f"{med((t.runs[name].ttft - t.runs[INPROC].ttft) * 1000 for t in triples):+.1f} ms"
            )
        )
        print(f"  {name:<17} {ttft:>8.1f} {tps:>9.1f}   {rel}")
    vs_inproc = med(t.shoal_vs_inproc for t in triples)
    vs_server = med(t.shoal_vs_server for t in triples)
    added = med(t.added_ms for t in triples)
    ok = [vs_inproc >= TPS_TARGET, vs_server >= TPS_SERVER_TARGET]
    lines = [
        (
            "Shoal / in-process tokens/s",
            f"{vs_inproc:7.4f}x",
            f">= {TPS_TARGET:.2f}x",
            iqr([t.shoal_vs_inproc for t in triples], "{:.3f}"),
        ),
        (
            "Shoal / llama_cpp.server",
            f"{vs_server:7.4f}x",
            f">= {TPS_SERVER_TARGET:.2f}x",
            iqr([t.shoal_vs_server for t in triples], "{:.3f}"),
        ),
    ]
    for (label, value, target, spread), good in zip(lines, ok, strict=True):
        aim = f"(target {target})"
        print(f"  {label:<28} {value:>9}  {aim:<18} {verdict(good)}   {spread}".rstrip())
    spread = iqr([t.added_ms for t in triples], "{:+.1f}")
    print(
        f"  {'Shoal TTFT - in-process':<28} {added:+6.1f} ms  (judged on the first tokens)"
        f"   {spread}"
    )
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
    print(
        f"  {'Shoal TTFT - in-process':<28} {added:+6.1f} ms  (target <= {TTFT_TARGET_MS:.0f} ms)"
        f" {verdict(good)}   {spread}"
    )
    return good


def cpu_table(triples: list[Triple], idle: dict[str, float], idle_s: float) -> None:
    print()
    print("CPU by part, median over the runs (`shoal up` = its own process: API, projector,")
    print("planner and worker), in ms per token and, in brackets, per request:")
    parts = {
        INPROC: [("this process", "bench")],
        SERVER: [("server", "server"), ("client", "bench")],
        SHOAL: [
            ("runner", "runner"),
            ("shoal up", "up"),
            ("nats-server", "nats"),
            ("client", "bench"),
        ],
    }
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
    print(
        f"Shoal's TTFT, step by step (median ms over {len(found)} runs, from the events' "
        "timestamps):"
    )
    total = 0.0
    for key, label in Trace.STEPS:
        ms = med(getattr(x, key) for _, x in found)
        total += ms
        print(f"  {ms:7.1f}  {label}")
    shoal = med(t.runs[SHOAL].ttft for t, _ in found) * 1000
    inproc = med(t.runs[INPROC].ttft for t, _ in found) * 1000
    runner = med(x.runner_ttft for _, x in found)
    outside = med(t.runs[SHOAL].ttft * 1000 - x.generate for t, x in found if x is not None)
    print(
        f"  {total:7.1f}  sum of the medians (Shoal's TTFT {shoal:.1f}; in-process {inproc:.1f};"
        f" the runner's own, task received -> first token, {runner:.1f})"
    )
    print(f"  {outside:7.1f}  outside the runner's TaskStarted -> first token (median)")


def texts_note(triples: list[Triple]) -> None:
    by_prompt: dict[int, set[str]] = {}
    for t in triples:
        for r in t.runs.values():
            by_prompt.setdefault(t.prompt, set()).add(r.text)
    same = sum(len(v) == 1 for v in by_prompt.values())
    print(
        f"outputs: identical across the three (and the repeats) for {same} of "
        f"{len(by_prompt)} prompts"
    )


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


def burst_table(bursts: list[Burst], limit: int) -> None:
    print()
    print(
        f"{bursts[0].streams if bursts else 0} concurrent streams of {limit} tokens each: "
        "aggregate tokens/s = all completion tokens / wall time"
    )
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
