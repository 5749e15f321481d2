"""One image in, measured the same way against any server: a one-image chat request and the
same request without its image, round by round, each round a new image (``bench.vision``
against llama-server, ``bench.mlx_vision`` against mlx-vlm)."""

from __future__ import annotations

import base64
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench.common.report import verdict
from harness.images import drawn_png

SHOAL = "shoal up"
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


def report(a: Timings, s: Timings, anchor: str) -> bool:
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
        print(f"| {what} | {x:.3f} | {y:.3f} | {r:.2f}x | >= 0.9x {verdict(met)} |")
    print(
        f"| the same request without its image: first token, s | {text_a:.3f} | {text_s:.3f} |"
        f" {text_a / text_s:.2f}x | |"
    )
    print(
        f"\nWhat the image adds to the first token: {anchor} {ttft_a - text_a:.3f} s,"
        f" Shoal {ttft_s - text_s:.3f} s"
    )
    return ok
