"""One image in, side by side in one run: llama.cpp's ``llama-server -m MODEL --mmproj PROJ``
and ``shoal up`` with the same model added with the same projector (``shoal models add ...
--mmproj``), the same GGUF files, the same threads, one slot each, both started and asked in
turns, round by round.

The model is the tests' SmolLM2-135M-Instruct with the tests' random-weight projector
(``tests/vision.py``: 64 image tokens, an encoder of 2 tiny blocks): no real vision model runs
here, what is measured is the path an image takes, which a real projector only makes longer
(its encoder's time, reported apart). Each round sends a new image (its colours change), so
that neither side answers from a prompt cache of the image.

For each: the time to the first streamed token of a one-image chat request, and the tokens/s
of the 48 tokens after it, medians of ``--rounds``. Target (issue 36): Shoal >= 0.9x
llama-server on both (TTFT: llama-server's / Shoal's).

    .venv/bin/python -m bench.vision
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common.processes import Proc, add_model, shoal_env, shoal_up_argv, wait_shoal_ready
from bench.concurrency import gguf, wait_http
from bench.llama_server import llama_server
from bus.embedded import free_port
from tests.images import drawn_png
from tests.vision import write_tiny_projector

MODEL = "smollm2-135m"
ANCHOR, SHOAL = "llama-server --mmproj", "shoal up"
TOKENS = 48
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class Timings:
    ttft: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    # The same request without its image: what the image adds, apart from the serving path.
    text_ttft: list[float] = field(default_factory=list)


def image(round_: int) -> str:
    """A data URL of a 64x64 PNG of its own for each round."""
    png = drawn_png(64, 64, lambda x, y: ((x * 4 + round_ * 37) % 256, (y * 4) % 256, round_ % 256))
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


async def one(
    client: httpx.AsyncClient, url: str, model: str, round_: int, with_image: bool = True
) -> tuple[float, float]:
    """TTFT and the tokens/s after the first token of a one-image chat request (or of the
    same request without its image)."""
    shown = [{"type": "image_url", "image_url": {"url": image(round_)}}] if with_image else []
    # Each round's text differs from its first word on, so that the prompt a request shares
    # with any earlier one ends with the template's header: llama-server keeps earlier prompts
    # in RAM (its --cache-ram) and would reuse the words a text-only request shares with the
    # one before, where Shoal's slot holds only the last prompt.
    text = f"{LETTERS[round_ % len(LETTERS)]}. Describe this picture in detail."
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [*shown, {"type": "text", "text": text}]}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
    }
    started = time.monotonic()
    first = last = 0.0
    tokens = 0
    async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"content"' not in line:
                continue
            now = time.monotonic()
            tokens += 1
            if tokens == 1:
                first = now
            last = now
    if tokens < 2:
        raise RuntimeError(f"{url}: {tokens} tokens")
    return first - started, (tokens - 1) / (last - first)


async def measure(urls: dict[str, str], models: dict[str, str], rounds: int) -> dict[str, Timings]:
    """Both servers, round by round: each round, each serves one image request and the same
    request without its image, the one that goes first alternating, so that what the machine
    does meanwhile falls on both alike. ``models``: the model's name on each."""
    timings = {name: Timings() for name in urls}
    # A connection each request, both sides: llama-server closes an idle kept-alive one at
    # times just as the next request goes out on it.
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=fresh) as client:
        for name, url in urls.items():
            # warm-up: the first request's one-off costs
            await one(client, url, models[name], rounds)
        for i in range(rounds):
            for name in list(urls) if i % 2 == 0 else reversed(list(urls)):
                t, url, model = timings[name], urls[name], models[name]
                ttft, rate = await one(client, url, model, i)
                t.ttft.append(ttft)
                t.tokens_per_s.append(rate)
                t.text_ttft.append((await one(client, url, model, i, False))[0])
    return timings


@contextlib.asynccontextmanager
async def anchor(
    binary: Path, model: Path, projector: Path, threads: int, tmp: Path
) -> AsyncIterator[str]:
    """llama-server, started; its API's URL."""
    port = free_port("127.0.0.1")
    argv = [
        str(binary),
        "-m",
        str(model),
        "--mmproj",
        str(projector),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        "2048",
        "--parallel",
        "1",
        "--no-webui",
    ]
    proc = Proc(ANCHOR, argv, tmp / "llama-server.log")
    await proc.start()
    try:
        await wait_http(proc, f"http://127.0.0.1:{port}/health", "health")
        yield f"http://127.0.0.1:{port}/v1"
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.stop()


@contextlib.asynccontextmanager
async def shoal(model: Path, projector: Path, threads: int, tmp: Path) -> AsyncIterator[str]:
    """`shoal up` with the model added with its projector; its API's URL."""
    port = free_port("127.0.0.1")
    data = tmp / "up"
    argv = shoal_up_argv(data, None, port, threads)
    proc = Proc(SHOAL, argv, tmp / "up.log")
    await proc.start(shoal_env())
    try:
        await wait_shoal_ready(proc)
        await add_model(proc, data, MODEL, "--path", str(model), "--mmproj", str(projector))
        yield f"http://127.0.0.1:{port}/v1"
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.stop()


def encode_ms(log: Path) -> str:
    """llama-server's own figure for the image encoder (libmtmd logs it per image)."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "encoded in" in x]
    return lines[-1].strip() if lines else "not logged"


def report(a: Timings, s: Timings, anchor: str = ANCHOR) -> bool:
    """The table of medians, Shoal against ``anchor``; whether both targets are met."""
    ttft_a, ttft_s = statistics.median(a.ttft), statistics.median(s.ttft)
    rate_a, rate_s = statistics.median(a.tokens_per_s), statistics.median(s.tokens_per_s)
    text_a, text_s = statistics.median(a.text_ttft), statistics.median(s.text_ttft)
    rows = [
        ("first token of a one-image request, s", ttft_a, ttft_s, ttft_a / ttft_s),
        (f"tokens/s of the {TOKENS - 1} after it", rate_a, rate_s, rate_s / rate_a),
    ]
    print(f"| median | {anchor} | {SHOAL} | Shoal vs it | target |")
    print("|---|---|---|---|---|")
    ok = True
    for what, x, y, r in rows:
        met = r >= 0.9
        ok &= met
        print(f"| {what} | {x:.3f} | {y:.3f} | {r:.2f}x | >= 0.9x{'' if met else ' MISSED'} |")
    print(
        f"| the same request without its image: first token, s | {text_a:.3f} | {text_s:.3f} |"
        f" {text_a / text_s:.2f}x | |"
    )
    print(
        f"\nWhat the image adds to the first token: {anchor} {ttft_a - text_a:.3f} s,"
        f" Shoal {ttft_s - text_s:.3f} s"
    )
    return ok


async def run(args: argparse.Namespace) -> int:
    binary = llama_server()
    with tempfile.TemporaryDirectory(prefix="shoal-vision-") as d:
        tmp = Path(d)
        model = gguf(MODEL, tmp)
        projector = tmp / "tiny-mmproj.gguf"
        write_tiny_projector(projector)
        print(
            f"# One image: {MODEL} with a random-weight projector (tests/vision.py),"
            f" {args.threads} threads, {args.rounds} rounds",
            file=sys.stderr,
        )
        async with (
            anchor(binary, model, projector, args.threads, tmp) as anchor_url,
            shoal(model, projector, args.threads, tmp) as shoal_url,
        ):
            urls = {ANCHOR: anchor_url, SHOAL: shoal_url}
            timings = await measure(urls, {ANCHOR: MODEL, SHOAL: MODEL}, args.rounds)
        print(f"llama-server's image encoder: {encode_ms(tmp / 'llama-server.log')}")
    return 0 if report(timings[ANCHOR], timings[SHOAL]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    parser.add_argument("--rounds", type=int, default=10, help="requests measured, each side")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
