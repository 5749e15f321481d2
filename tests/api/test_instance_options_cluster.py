"""An instance's options, end to end on the session's `shoal up`: the same SmolLM2 GGUF added
under another id, asked for through ``POST /v1/instances`` with a quantized KV cache
(``kv_cache: "q8_0"``: placed with that type, its runner started with it, a chat answered by
it) or with speculative decoding (the same answer as the session's own instance of SmolLM2).
Each instance is deleted afterwards, so the session's other tests see the cluster as it
was."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.processes import SHOAL
from tests.api.up_cluster import UpCluster
from tests.inference.engines.llamacpp.test_batch import SMOLLM2

pytestmark = pytest.mark.slow

MODEL = "smollm2-q8-cache"
DRAFTING = "smollm2-drafts"


def _add_model(nats_url: str, cache: Path, model: str = MODEL) -> None:
    argv = [SHOAL, "models", "add", model, "--path", str(SMOLLM2), "--nats", nats_url]
    done = subprocess.run(
        [*argv, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr


async def test_an_instance_with_a_q8_0_cache_serves(up_cluster: UpCluster, tmp_path: Path) -> None:
    await asyncio.to_thread(_add_model, up_cluster.nats_url, tmp_path / "cache")
    headers = {"Authorization": f"Bearer {up_cluster.key}"}
    async with httpx.AsyncClient(base_url=up_cluster.base, headers=headers, timeout=60) as c:
        asked = {"model": MODEL, "kv_cache": "q8_0", "slots": 2, "context_length": 1024}
        created = await c.post("/v1/instances", json=asked)
        assert created.status_code == 202, created.text
        assert created.json()["preview"]["kv_cache"] == "q8_0"
        iid = created.json()["id"]
        try:
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
            async with asyncio.timeout(180):
                while True:
                    r = await c.post("/v1/chat/completions", json=chat)
                    if r.status_code == 200:
                        break
                    assert r.status_code == 503, r.text  # placed, loading
                    await asyncio.sleep(0.5)
            answer = r.json()
            assert answer["choices"][0]["message"]["content"]
            assert answer["usage"]["completion_tokens"] >= 1
            inst = (await c.get(f"/v1/instances/{iid}")).json()
            assert (inst["requested_kv_cache"], inst["kv_cache"]) == ("q8_0", "q8_0")
            assert [s["state"] in ("Ready", "Running") for s in inst["shards"]] == [True]
        finally:
            await c.delete(f"/v1/instances/{iid}")


async def _answer(c: httpx.AsyncClient, chat: dict[str, object]) -> dict[str, Any]:
    """The chat's answer, once the model's instance serves (503 while it loads)."""
    async with asyncio.timeout(180):
        while True:
            r = await c.post("/v1/chat/completions", json=chat)
            if r.status_code == 200:
                answer: dict[str, Any] = r.json()
                return answer
            assert r.status_code == 503, r.text
            await asyncio.sleep(0.5)


async def test_an_instance_that_drafts_answers_as_one_that_does_not(
    up_cluster: UpCluster, tmp_path: Path
) -> None:
    await asyncio.to_thread(_add_model, up_cluster.nats_url, tmp_path / "cache", DRAFTING)
    headers = {"Authorization": f"Bearer {up_cluster.key}"}
    async with httpx.AsyncClient(base_url=up_cluster.base, headers=headers, timeout=60) as c:
        drafts = {"type": "ngram", "draft_max": 8, "ngram_min": 2, "ngram_max": 4}
        asked = {"model": DRAFTING, "speculative": drafts, "slots": 2, "context_length": 1024}
        created = await c.post("/v1/instances", json=asked)
        assert created.status_code == 202, created.text
        iid = created.json()["id"]
        try:
            count = "one, two, three, four, five, six, seven, eight, nine, ten"
            chat: dict[str, object] = {
                "messages": [{"role": "user", "content": f"Repeat after me: {count}. {count}."}],
                "max_tokens": 40,
                "temperature": 0,
            }
            drafted = await _answer(c, chat | {"model": DRAFTING})
            plain = await _answer(c, chat | {"model": up_cluster.model})
            text = drafted["choices"][0]["message"]["content"]
            assert text and text == plain["choices"][0]["message"]["content"]
            assert drafted["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
            inst = (await c.get(f"/v1/instances/{iid}")).json()
            assert inst["speculative"] == drafts
        finally:
            await c.delete(f"/v1/instances/{iid}")
