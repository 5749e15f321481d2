"""The API's per-model defaults (``shoal api --model-defaults FILE``) reach the instances it asks
for on demand: real nats-server, projector, planner and `shoal api` processes, no worker. Each
model's file placement names a node the cluster does not have, so that the planner rejects it
at once and the request is answered (503, the planner's reason) instead of waiting for a load;
what matters is the ``InstanceRequested`` on the log."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from nats.js import JetStreamContext

from bus.publisher import Publisher
from bus.reader import read_stream
from bus.streams import EVENTS_STREAM
from events.catalogue import (
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    parse_event,
)
from events.records import NodeProfile
from events.units import MiB
from harness.processes import wait_healthy
from tests.api.conftest import ApiStack

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
ELSEWHERE = {"chat": {"devices": ["elsewhere:cpu"]}}
DEFAULTS = {
    "m:latest": {"keep_alive": "10m", "context_length": 1024, "placement": ELSEWHERE},
    "always": {"pinned": True, "placement": ELSEWHERE},  # an alias of p (--alias)
    "k": {"keep_alive": "1h", "placement": ELSEWHERE},
}


async def _cluster(js: JetStreamContext) -> None:
    """A node with room for each model (the file's placement aside), and three models."""
    pub = Publisher(js)
    await pub.publish(NodeJoined(node_id="n1", origin="n1", heartbeat_s=3600))
    profile = NodeProfile(
        ram_total=4096 * MiB, ram_available=2048 * MiB, cpu_count=2, memory_offered=2048 * MiB
    )
    await pub.publish(ResourceProfiled(node_id="n1", origin="n1", profile=profile))
    for model_id in ("m", "p", "k"):
        await pub.publish(
            ModelAdded(model_id=model_id, origin="test", n_layers=10, size_bytes=100 * MiB)
        )


async def _refused(r: httpx.Response) -> str:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    return error if isinstance(error, str) else str(error["message"])


async def test_a_default_keep_alive_a_pinned_model_and_a_placement_take_effect(
    api_stack: ApiStack, js: JetStreamContext, tmp_path: Path
) -> None:
    api_stack.procs.start(
        "planner", "planner", "--nats", api_stack.nats_url, "--db", api_stack.db_url
    )
    await _cluster(js)
    defaults = tmp_path / "defaults.json"
    defaults.write_text(json.dumps(DEFAULTS))
    url = api_stack.start_api(
        "loading", "--alias", "always=p", "--model-defaults", str(defaults), load_on_demand=True
    )
    await wait_healthy(url)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        chat = await client.post("/v1/chat/completions", json={"model": "m", "messages": HI})
        assert "unknown node 'elsewhere'" in await _refused(chat)  # the file's placement
        pinned = await client.post("/api/chat", json={"model": "p", "messages": HI})
        assert "unknown node 'elsewhere'" in await _refused(pinned)
        own = {"model": "k", "prompt": "hi", "keep_alive": "1m", "stream": False}
        await _refused(await client.post("/api/generate", json=own))

    asked = {
        e.model_id: e
        async for m in read_stream(js, EVENTS_STREAM, "shoal.events.>")
        if isinstance(e := parse_event(m.data), InstanceRequested)
    }
    m, p, k = asked["m"], asked["p"], asked["k"]
    # The file's keep-alive (600 s), context and placement (its chat entry), on demand.
    assert (m.instance_id, m.on_demand, m.keep_alive_s) == ("m-chat-on-demand-0", True, 600.0)
    assert (m.context_length, m.placement) == (1024, '{"chat":{"devices":["elsewhere:cpu"]}}')
    # Pinned (by its alias): asked for as an explicit instance is, never unloaded unless asked.
    assert (p.instance_id, p.on_demand, p.keep_alive_s) == ("p-chat-on-demand-0", False, None)
    assert p.reason.endswith("; pinned (--model-defaults)"), p.reason
    # The request's own keep_alive (Ollama's "1m") wins over the file's hour.
    assert (k.on_demand, k.keep_alive_s) == (True, 60.0)
