"""Ollama's DELETE /api/delete removes the model, as Ollama does: its live instances deleted,
then the model (its bucket objects with it). Real projector and API processes, no runner."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.js import JetStreamContext

from bus.publisher import Publisher
from bus.reader import read_stream
from bus.stores.object_store import object_info
from bus.streams import EVENTS_STREAM, MODELS_BUCKET
from events.catalogue import InstanceRequested, ModelAdded, parse_event
from services.models.shared import store_files
from tests.api.conftest import ApiStack

pytestmark = pytest.mark.slow


async def _tags(client: httpx.AsyncClient) -> list[str]:
    body: dict[str, Any] = (await client.get("/api/tags")).json()
    return [m["name"] for m in body["models"]]


async def _instances(client: httpx.AsyncClient) -> list[str]:
    body: dict[str, Any] = (await client.get("/v1/instances")).json()
    return [i["id"] for i in body["data"]]


def _weights(path: Path) -> Path:
    path.write_bytes(os.urandom(200_000))
    return path


async def test_delete_removes_the_model_after_its_instances(
    api_stack: ApiStack, js: JetStreamContext, tmp_path: Path
) -> None:
    path = _weights(tmp_path / "m.gguf")
    (f,) = await store_files(js, [(path.name, path)])
    pub = Publisher(js)
    await pub.publish(ModelAdded(model_id="m", origin="t", n_layers=1, size_bytes=1, files=[f]))
    await pub.publish(InstanceRequested(instance_id="i1", model_id="m", origin="t"))
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        async with asyncio.timeout(20):
            while "m:latest" not in await _tags(client) or not await _instances(client):
                await asyncio.sleep(0.1)
        gone = await client.request("DELETE", "/api/delete", json={"model": "m:latest"})
        assert gone.status_code == 200, gone.text
        assert gone.json() == {"status": "success", "deleted": ["i1"]}
        assert await object_info(js, MODELS_BUCKET, f.object) is None
        async with asyncio.timeout(20):
            while "m:latest" in await _tags(client):
                await asyncio.sleep(0.1)
        again = await client.request("DELETE", "/api/delete", json={"model": "m"})
        assert again.status_code == 404 and again.json() == {"error": "model 'm' not found"}

    events = [
        type(parse_event(m.data)).__name__
        async for m in read_stream(js, EVENTS_STREAM, "shoal.events.>")
    ]
    assert events[-2:] == ["InstanceDeleteRequested", "ModelRemoved"]
