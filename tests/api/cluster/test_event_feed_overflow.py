"""GET /v1/events against real processes: a client that reads nothing while tens of MiB of
events pass is told it cannot keep up and let go, the API's memory stays flat, and a client that
keeps up gets every event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import psutil
import pytest
from nats.js import JetStreamContext

from bus.streams import CHUNKS_STREAM
from events.subjects import ALL_CHUNKS, chunk_subject
from events.units import KiB, MiB
from tests.api.conftest import ApiStack

pytestmark = pytest.mark.slow

SIZE = 512 * KiB
COUNT = 100  # 50 MiB in all, six times the API's 8 MiB per client
BATCH = 8  # published before waiting for the client that keeps up: 4 MiB, under its bound


def _payload(n: int) -> bytes:
    head = b'{"type":"ChunkGenerated","n":%d,"pad":"' % n
    return head + b"x" * (SIZE - len(head) - 2) + b'"}'


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event, data) of each server-sent event; comments skipped."""
    kind = ""
    async for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, line.removeprefix("data: ")


async def _until_bound(js: JetStreamContext, clients: int) -> None:
    """Until the chunk stream has this many consumers someone is subscribed to (one per feed
    client; the server notes a subscription a moment after the consumer is made)."""
    async with asyncio.timeout(10):
        while sum(1 for c in await js.consumers_info(CHUNKS_STREAM) if c.push_bound) != clients:
            await asyncio.sleep(0.02)


async def test_a_client_that_cannot_keep_up_is_told_and_let_go(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    api = psutil.Process(api_stack.procs.procs["api"].pid)
    params = {"subject": ALL_CHUNKS}
    async with (
        httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client,
        client.stream("GET", "/v1/events", params=params) as stalled,
        client.stream("GET", "/v1/events", params=params) as keeping_up,
    ):
        stalled_lines = stalled.aiter_lines()
        assert (await anext(stalled_lines)).startswith(":")  # subscribed; then read no more
        lines = keeping_up.aiter_lines()
        assert (await anext(lines)).startswith(":")
        await _until_bound(js, 2)

        received: list[int] = []

        async def keep_up() -> None:
            async for kind, data in _events(lines):
                assert kind == "ChunkGenerated", data[:200]
                received.append(json.loads(data)["n"])

        peak = baseline = api.memory_info().rss

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, api.memory_info().rss)
                await asyncio.sleep(0.01)

        reader, watcher = asyncio.create_task(keep_up()), asyncio.create_task(watch())
        try:
            async with asyncio.timeout(30):
                for n in range(COUNT):
                    await js.publish(chunk_subject("big"), _payload(n), stream=CHUNKS_STREAM)
                    if n % BATCH == BATCH - 1 or n == COUNT - 1:
                        while len(received) < n + 1:
                            if reader.done():  # its failure, rather than a timeout
                                reader.result()
                                raise AssertionError(f"the feed ended after {received}")
                            await asyncio.sleep(0.005)
                # The stalled client's subscription is gone before it reads anything.
                await _until_bound(js, 1)
        finally:
            watcher.cancel()
            reader.cancel()
        peak = max(peak, api.memory_info().rss)
        # What the old queue of 10,000 events would have held for the stalled client: the 50
        # MiB, less what the sockets took. Now 8 MiB at most, and copies on their way.
        growth = (peak - baseline) / MiB
        assert growth < 32, f"the API grew by {growth:.0f} MiB"
        assert received == list(range(COUNT))  # every event, in order, and no error

        # The stalled client reads at last: what had reached its socket, then why it was let
        # go, and the end of the stream.
        seen: list[tuple[str, str]] = []
        async with asyncio.timeout(10):
            async for kind, data in _events(stalled_lines):
                seen.append((kind, data))
        kind, data = seen[-1]
        assert kind == "error"
        error = json.loads(data)["error"]
        assert error["code"] == "events_overflow" and "cannot keep up" in error["message"]
        numbers = [json.loads(d)["n"] for k, d in seen[:-1]]
        assert numbers == list(range(len(numbers))) and len(numbers) < COUNT
