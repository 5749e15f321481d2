"""`shoal up` end to end, driven by the official OpenAI SDK, unchanged."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bus.connection import connect
from bus.embedded import free_port
from events.catalogue import TaskCancelled
from harness.processes import SHOAL
from harness.shoal_up import read_until_ready, start, stop
from tests.api.test_metrics import parse, value
from tests.cli.shoal_up import KEY, MODEL
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow


@dataclass
class Up:
    url: str  # the API's /v1 URL
    nats_url: str
    output: list[str]


@pytest.fixture
async def up(tmp_path: Path) -> AsyncIterator[Up]:
    """`shoal up --data-dir data`, typed in a directory as a user would: a relative path."""
    port = free_port("127.0.0.1")
    proc = start(
        [
            SHOAL,
            "up",
            "--data-dir",
            "data",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--runner-threads",
            "1",
        ],
        cwd=tmp_path,
    )
    try:
        lines = await read_until_ready(proc)
        nats = re.search(r"^NATS\s+(\S+)", "".join(lines), re.MULTILINE)
        assert nats is not None
        yield Up(f"http://127.0.0.1:{port}/v1", nats.group(1), lines)
    finally:
        rest = stop(proc)
        sys.stdout.write(rest[-3000:])
    assert proc.returncode == 0 and "stopped" in rest


async def test_the_openai_sdk_works_against_shoal_up(up: Up) -> None:
    client = openai.AsyncOpenAI(base_url=up.url, api_key=KEY)
    question: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the capital city of France? Answer in one word."}
    ]

    reply = await client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=8, temperature=0
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=question,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == reply.choices[0].message.content  # greedy: the same text
    assert finish == reply.choices[0].finish_reason and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )
    # The same prompt again: its slot's cache held all of it but the last token.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

    story: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me a long story about a fox."}
    ]
    capped = await client.chat.completions.create(
        model=MODEL, messages=story, max_completion_tokens=5, temperature=0
    )
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage is not None and capped.usage.completion_tokens == 5
    stop_word = (capped.choices[0].message.content or "").split()[-1]
    stopped = await client.chat.completions.create(
        model=MODEL, messages=story, stop=[stop_word], max_tokens=20, temperature=0
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop_word not in (stopped.choices[0].message.content or "")

    text = await client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens <= 4

    models = await client.models.list()
    # Every model that can be asked for, with Shoal's fields: the one added (and loaded), then
    # the catalogue's other cards, not added (a request for one loads it on demand).
    shoal = {m.id: (m.model_extra or {}) for m in models.data}
    assert [name for name, extra in shoal.items() if extra["added"]] == [MODEL]
    assert shoal[MODEL] == {"loaded": True, "added": True, "capabilities": ["completion"]}
    assert shoal["gemma3-270m"] == {"loaded": False, "added": False, "capabilities": ["completion"]}
    assert "vision" in shoal["smolvlm-256m"]["capabilities"]  # a card with a projector

    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="no-such-model", messages=question)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=question, n=9)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[])
    too_long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "fox " * 3000}]
    with pytest.raises(openai.BadRequestError, match="context"):
        await client.chat.completions.create(model=MODEL, messages=too_long, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=up.url, api_key="wrong").models.list()


async def test_a_client_that_goes_away_cancels_its_task(up: Up) -> None:
    nc = await connect(up.nats_url)
    log = await EventLog().start(nc.jetstream())
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 400,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        httpx.AsyncClient(timeout=60, headers=headers) as client,
        client.stream("POST", f"{up.url}/chat/completions", json=body) as response,
    ):
        lines = response.aiter_lines()
        for _ in range(6):  # a few tokens in
            await anext(lines)
    # Leaving the block closed the connection mid-stream.
    cancelled = await log.wait_for(TaskCancelled, timeout=15)
    chunks = await log.wait_chunks(cancelled.task_id, timeout=15)
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) < 400
    await log.stop()
    await nc.close()


async def test_metrics_count_tokens_and_streams_still_stream(up: Up) -> None:
    """A chat and a streamed chat: the stream arrives token by token through the API's request
    counting, and /metrics has the tokens, the time to first token and tokens/s."""
    story = [{"role": "user", "content": "Tell me a long story about a fox."}]
    body = {"model": MODEL, "messages": story, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    base = up.url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
        whole = await client.post("/v1/chat/completions", json=body | {"max_tokens": 12})
        assert whole.status_code == 200, whole.text
        tokens = whole.json()["usage"]["completion_tokens"]
        arrivals: list[float] = []
        streamed = body | {
            "max_tokens": 48,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        arrivals.append(time.monotonic())
                    tokens += (chunk.get("usage") or {}).get("completion_tokens", 0)
        assert len(arrivals) > 10
        assert arrivals[-1] - arrivals[0] > 0.1  # not all at once, at the end

        r = await client.get("/metrics")
        assert r.status_code == 200
        s = parse(r.text)
    assert value(s, "shoal_tokens_generated_total", model=MODEL) == tokens
    assert value(s, "shoal_time_to_first_token_seconds_count", model=MODEL) == 2
    assert 0 < (value(s, "shoal_time_to_first_token_seconds_sum", model=MODEL) or 0) < 120
    assert value(s, "shoal_tokens_per_second_count", model=MODEL) == 2
    assert value(s, "shoal_events_published_total", type="TaskCreated") == 2
    chats = {"method": "POST", "endpoint": "/v1/chat/completions", "status": "200"}
    assert value(s, "shoal_http_requests_total", **chats) == 2
    serving = sum(value(s, "shoal_runners", state=st) or 0 for st in ("Ready", "Running"))
    assert serving == 1
    assert value(s, "shoal_nodes", status="online") == 1


async def test_one_machine_as_two_nodes_serves_a_model_neither_holds(tmp_path: Path) -> None:
    """`shoal up` with a memory limit too small for SmolLM2 says so and waits; a second worker
    (`shoal join`) with the same limit joins, and the model is split over the two and answers.
    Both are given relative data dirs, as a user types them."""
    port = free_port("127.0.0.1")
    proc = start(
        [
            SHOAL,
            "up",
            "--data-dir",
            "a",
            "--port",
            str(port),
            "--memory-limit",
            "160M",
            "--runner-threads",
            "1",
        ],
        cwd=tmp_path,
    )
    joined: subprocess.Popen[str] | None = None
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        async with asyncio.timeout(120):
            while not any("cannot be placed" in line for line in lines):
                lines.append(await asyncio.to_thread(proc.stdout.readline))
        nats = re.search(r"^NATS\s+(\S+)", "".join(lines), re.MULTILINE)
        assert nats is not None
        joined = start(
            [
                SHOAL,
                "join",
                "--nats",
                nats.group(1),
                "--memory-limit",
                "160M",
                "--node-id",
                "b",
                "--data-dir",
                "b",
                "--runner-threads",
                "1",
            ],
            cwd=tmp_path,
        )
        lines += await read_until_ready(proc)
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={
                    "model": MODEL,
                    "max_tokens": 8,
                    "temperature": 0,
                    "messages": [
                        {
                            "role": "user",
                            "content": "What is the capital city of France? Answer in one word.",
                        }
                    ],
                },
            )
            assert answer.status_code == 200, answer.text
            assert "Paris" in answer.json()["choices"][0]["message"]["content"]
            state = (await client.get(f"http://127.0.0.1:{port}/v1/instances")).json()
        shards = state["data"][0]["shards"]
        assert sorted(s["rank"] for s in shards) == [0, 1]
        assert len({s["node_id"] for s in shards}) == 2
    finally:
        if joined is not None:
            os.killpg(joined.pid, signal.SIGINT)
            joined.wait(60)
        rest = stop(proc)
        sys.stdout.write("".join(lines)[-3000:] + rest[-3000:])
    assert "stopped" in rest
