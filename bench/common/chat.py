"""Streamed chat completions as a client sees them: the prompts, the request, and the lines of
a streamed answer timestamped as they arrive (``Stream`` for OpenAI chat's chunks).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common.processes import MODEL_ID

# Chat prompts SmolLM2 answers at length: under greedy decoding none ends before 256 tokens.
PROMPTS = (
    "Write a long story about a dragon who wants to become a baker.",
    "Write a detailed essay on the history of the Roman Empire.",
    "Write a long, detailed guide to growing tomatoes in a small garden.",
    "Write a long story about a robot exploring an abandoned city.",
    "Write a long story about two friends sailing around the world.",
)


async def timed_lines(
    client: httpx.AsyncClient, name: str, url: str, body: dict[str, Any]
) -> list[tuple[float, str]]:
    """A streamed request's lines, each with its arrival (perf_counter): parsed afterwards, so
    that the client does as little as possible while the server generates."""
    clock = time.perf_counter
    lines: list[tuple[float, str]] = []
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"{name}: HTTP {r.status_code}: {text[:500]}")
        async for line in r.aiter_lines():
            lines.append((clock(), line))
    return lines


@dataclass
class Stream:
    """What a client saw of one streamed completion; perf_counter seconds."""

    start: float
    pieces: list[tuple[float, str]] = field(default_factory=list)  # arrival, non-empty text
    finish: str | None = None
    usage_tokens: int | None = None  # from the usage chunk, when the server sends one
    response_id: str = ""
    wall_start: float = 0.0  # time.time() at ``start``

    def count(self, limit: int) -> int:
        """Completion tokens: the usage when given, else ``limit`` when the finish reason says
        the limit was reached (llama-cpp-python's rule), else the chunks with text."""
        if self.usage_tokens is not None:
            return self.usage_tokens
        return limit if self.finish == "length" else len(self.pieces)

    def wall(self, t: float) -> float:
        return self.wall_start + (t - self.start)


def add_chunk(stream: Stream, at: float, chunk: dict[str, Any]) -> None:
    stream.response_id = stream.response_id or str(chunk.get("id", ""))
    if usage := chunk.get("usage"):
        stream.usage_tokens = int(usage["completion_tokens"])
    for choice in chunk.get("choices") or []:
        if text := (choice.get("delta") or {}).get("content"):
            stream.pieces.append((at, text))
        if choice.get("finish_reason"):
            stream.finish = str(choice["finish_reason"])


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "repeat_penalty": 1.0,  # llama-cpp-python's own default; its server's is 1.1
        "stream": True,
        "stream_options": {"include_usage": True},  # Shoal reports usage; llama_cpp ignores it
    }


class HttpContender:
    """An OpenAI-compatible server, asked for streamed chat completions."""

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient) -> None:
        self.name = name
        self.base_url = base_url
        self.client = client

    async def stream(self, prompt: str, max_tokens: int) -> Stream:
        body, url = chat_body(prompt, max_tokens), f"{self.base_url}/chat/completions"
        s = Stream(start=time.perf_counter(), wall_start=time.time())
        lines = await timed_lines(self.client, self.name, url, body)
        for at, line in lines:
            if line.startswith("data:") and (data := line[5:].strip()) != "[DONE]":
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: {chunk['error']}")
                add_chunk(s, at, chunk)
        return s


# What the varied prompts are about (``bench.concurrency``), and the long turn's notes.
TOPICS = (
    "a lighthouse keeper",
    "a city under the sea",
    "the first Mars colony",
    "a chess prodigy",
    "a forgotten library",
    "a robot gardener",
    "a winter festival",
    "a travelling circus",
)

# About 1,500 tokens of a conversation's first turn (SmolLM2's tokenizer), for the prompt cache.
LONG_TURN = " ".join(
    f"Note {i}: the {TOPICS[i % len(TOPICS)]} kept a diary, and on day {i} it rained."
    for i in range(64)
)
