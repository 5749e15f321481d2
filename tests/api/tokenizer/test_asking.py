"""Asking a model's runner about its tokenizer, from a real `shoal api` (no real runner: the
projection's runner is events, and the one that answers is a tokenizer service in this test):
the model must serve as for a chat (the chat's 404 and 503), a Ready runner that does not
answer is a 503, and once one answers its answer is the response."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.publisher import Publisher
from events.catalogue import (
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    RunnerStateChanged,
)
from events.records import NodeProfile
from events.units import MiB
from inference.engines.base import Engine
from services.runner.tokenizer_service import TokenizerService
from tests.api.conftest import ApiStack

pytestmark = pytest.mark.slow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class _Letters:
    """A tokenizer of one token per character; a template that writes the contents alone."""

    n_ctx = 4096
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [ord(c) for c in text]

    def chat_tokens(self, messages: list[dict[str, Any]], *rest: Any) -> list[int]:
        return [ord(c) for m in messages for c in m["content"]]


async def _known_model(js: JetStreamContext) -> None:
    pub = Publisher(js)
    await pub.publish(NodeJoined(node_id="n1", origin="n1", heartbeat_s=3600))
    profile = NodeProfile(
        ram_total=4096 * MiB, ram_available=2048 * MiB, cpu_count=2, memory_offered=2048 * MiB
    )
    await pub.publish(ResourceProfiled(node_id="n1", origin="n1", profile=profile))
    await pub.publish(
        ModelAdded(
            model_id="m",
            origin="test",
            n_layers=10,
            size_bytes=100 * MiB,
            context_length=4096,
            kv_bytes_per_token=1024,
        )
    )


async def _status_when(
    client: httpx.AsyncClient, body: dict[str, Any], status: int, says: str = ""
) -> Any:
    """The first answer with ``status`` whose error says ``says`` (the API's projection may
    show an event a moment after it is on the log)."""
    async with asyncio.timeout(20):
        while True:
            r = await client.post("/tokenize", json=body)
            if r.status_code == status and says in r.json().get("error", {}).get("message", ""):
                return r.json()
            await asyncio.sleep(0.1)


async def test_the_model_must_serve_and_its_runner_answers(
    api_stack: ApiStack, js: JetStreamContext, nc: Client
) -> None:
    api_stack.procs.start(
        "planner", "planner", "--nats", api_stack.nats_url, "--db", api_stack.db_url
    )
    await _known_model(js)
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        err = (await _status_when(client, {"model": "m", "content": "hi"}, 503))["error"]
        chat = (await client.post("/v1/chat/completions", json=CHAT)).json()["error"]
        assert err["code"] == chat["code"] == "model_not_ready"
        assert err["message"] == chat["message"]  # the chat's own refusal
        err = (await client.post("/tokenize", json={"model": "x", "prompt": "hi"})).json()
        assert err["error"]["code"] == "model_not_found"

        pub = Publisher(js)
        await pub.publish(InstanceRequested(instance_id="i", model_id="m", origin="test"))
        async with asyncio.timeout(20):
            while (inst := (await client.get("/v1/instances/i")).json()).get("status") != "placed":
                await asyncio.sleep(0.1)
        ready = RunnerStateChanged(
            runner_id=inst["shards"][0]["runner_id"],
            instance_id="i",
            node_id="n1",
            state="Ready",
            origin="n1",
        )
        await pub.publish(ready)
        # Ready on the log, but nobody answers: a 503 at once, not a wait.
        err = (await _status_when(client, {"content": "hi"}, 503, "no runner that answers"))[
            "error"
        ]
        assert err["code"] == "model_not_ready"

        service = TokenizerService(nc, cast(Engine, _Letters()), "m")
        await service.start()
        try:
            assert (await client.post("/tokenize", json={"content": "hi"})).json() == {
                "tokens": [104, 105]
            }
            counted = await client.post("/tokenize", json=CHAT)
            assert counted.json() == {"count": 2, "max_model_len": 4096, "tokens": [104, 105]}
            anthropic = await client.post(
                "/v1/messages/count_tokens",
                json=CHAT,
                headers={"anthropic-version": "2023-06-01"},
            )
            assert anthropic.json() == {"input_tokens": 2}
        finally:
            await service.stop()
