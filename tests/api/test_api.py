"""The HTTP API against real processes: errors, cluster endpoints, keys, statelessness."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from nats.js import JetStreamContext

from bus.publisher import Publisher
from events.catalogue import (
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    ResourceProfiled,
    RunnerStateChanged,
    TaskCancelled,
    parse_event,
)
from events.records import NodeProfile
from events.units import MiB
from harness.processes import wait_healthy
from services.models.catalogue import builtin_cards
from tests.api.conftest import ApiStack

pytestmark = pytest.mark.slow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _cluster(js: JetStreamContext) -> None:
    """A node and a model, as a worker and `shoal models add` would announce them."""
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


async def _until(client: httpx.AsyncClient, path: str, check: Any, timeout: float = 20) -> Any:
    async with asyncio.timeout(timeout):
        while True:
            body = (await client.get(path)).json()
            if check(body):
                return body
            await asyncio.sleep(0.1)


def _added(listed: dict[str, Any]) -> list[str]:
    """The names of ``GET /v1/models`` whose model the cluster has (the rest: catalogue cards
    not added yet)."""
    return [m["id"] for m in listed.get("data", []) if m["added"]]


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def test_cluster_endpoints_and_why_a_model_cannot_answer(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    api_stack.procs.start(
        "planner", "planner", "--nats", api_stack.nats_url, "--db", api_stack.db_url
    )
    await _cluster(js)
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        listed = await _until(client, "/v1/models", lambda b: _added(b) == ["m"])
        # The catalogue's cards are listed too, not added: a request for one would load it.
        cards = {m["id"]: m for m in listed["data"] if not m["added"]}
        assert set(cards) == set(builtin_cards())
        assert cards["smollm2-135m"] == {
            "id": "smollm2-135m",
            "object": "model",
            "owned_by": "shoal",
            "created": 0,
            "loaded": False,
            "added": False,
            "capabilities": ["completion"],
        }
        assert cards["smolvlm-256m"]["capabilities"] == ["completion", "vision"]
        card = (await client.get("/v1/models/gemma3-270m")).json()  # models.retrieve
        assert (card["id"], card["added"], card["loaded"]) == ("gemma3-270m", False, False)
        assert (await client.get("/healthz")).json()["status"] == "ok"

        err = _error(await client.post("/v1/chat/completions", json=CHAT), 503)
        assert "no instance of it is running" in err["message"]
        err = _error(await client.post("/v1/chat/completions", json=CHAT | {"model": "x"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"

        preview = (await client.post("/v1/placement/preview", json={"model": "m"})).json()
        assert preview["placeable"] and [s["node_id"] for s in preview["shards"]] == ["n1"]
        assert preview["slots"] == 8  # as many as fit, up to 8 (2 MiB of KV cache each)
        asked = {"model": "m", "slots": 3}
        assert (await client.post("/v1/placement/preview", json=asked)).json()["slots"] == 3
        assert preview["kv_cache"] == "f16"
        asked = {"model": "m", "kv_cache": "q8_0"}
        assert (await client.post("/v1/placement/preview", json=asked)).json()["kv_cache"] == "q8_0"
        err = _error(await client.post("/v1/instances", json={"model": "m", "kv_cache": "q5"}), 400)
        assert err["param"] == "kv_cache" and "q4_0" in err["message"]
        asked = {"model": "m", "speculative": {"type": "ngram", "ngram_min": 5, "ngram_max": 3}}
        err = _error(await client.post("/v1/instances", json=asked), 400)
        assert "ngram_min 5 is more than ngram_max 3" in err["message"]
        asked = {"model": "m", "role": "embed", "speculative": {"type": "ngram"}}
        err = _error(await client.post("/v1/instances", json=asked), 400)
        assert err["param"] == "speculative" and "generates no tokens" in err["message"]
        bad = {"model": "m", "placement": {"chat": {"devices": ["zz:cpu"]}}}
        err = _error(await client.post("/v1/instances", json=bad), 400)
        assert "unknown node 'zz'" in err["message"]

        asked = {"model": "m", "kv_cache": "auto", "speculative": {"type": "ngram", "draft_max": 8}}
        created = await client.post("/v1/instances", json=asked)
        assert created.status_code == 202
        iid = created.json()["id"]
        inst = await _until(client, f"/v1/instances/{iid}", lambda b: b.get("status") == "placed")
        assert [(s["node_id"], s["state"]) for s in inst["shards"]] == [("n1", "Assigned")]
        assert (inst["requested_slots"], inst["slots"]) == (None, 8)
        assert (inst["requested_kv_cache"], inst["kv_cache"]) == ("auto", "f16")  # f16 fits
        drafts = {"type": "ngram", "draft_max": 8, "ngram_min": 2, "ngram_max": 4}
        assert inst["speculative"] == drafts
        err = _error(await client.post("/v1/chat/completions", json=CHAT), 503)
        assert f"instance {iid} is starting (runners: Assigned)" in err["message"]

        state = (await client.get("/v1/state")).json()
        assert [n["node_id"] for n in state["nodes"]] == ["n1"]
        assert [d["device"] for d in state["nodes"][0]["devices"]] == ["cpu"]
        assert [i["id"] for i in state["instances"]] == [iid] and state["tasks"] == []

        # A second API process on the same NATS and database answers alike: no state of its own.
        other = api_stack.start_api("api-2")
        await wait_healthy(other)
        async with httpx.AsyncClient(base_url=other, timeout=30) as second:
            for path in ("/v1/models", "/v1/instances", "/v1/state", f"/v1/instances/{iid}"):
                assert (await client.get(path)).json() == (await second.get(path)).json(), path
            # A delete through one is seen through the other.
            assert (await second.delete(f"/v1/instances/{iid}")).status_code == 202
        await _until(client, "/v1/instances", lambda b: b["data"] == [])
        _error(await client.get(f"/v1/instances/{iid}x"), 404)


async def test_events_are_tailed_as_server_sent_events(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        _error(await client.get("/v1/events", params={"subject": "other.>"}), 400)
        params = {"subject": "shoal.events.node.>"}
        async with client.stream("GET", "/v1/events", params=params) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith(":")  # subscribed
            await _cluster(js)
            seen: list[str] = []
            async with asyncio.timeout(10):
                while len(seen) < 2:
                    line = await anext(lines)
                    if line.startswith("event: "):
                        seen.append(line.removeprefix("event: "))
                    elif line.startswith("data: "):
                        assert json.loads(line.removeprefix("data: "))["node_id"] == "n1"
            assert seen == ["NodeJoined", "ResourceProfiled"]  # not the model: filtered out


async def test_api_keys(api_stack: ApiStack) -> None:
    url = api_stack.start_api("api-keys", "--api-key", "sekrit-1", "--api-key", "sekrit-2")
    await wait_healthy(url)  # /healthz needs no key
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        err = _error(await client.get("/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer guess-123"})
        assert "guess-123" not in _error(wrong, 401)["message"]  # a key is never echoed
        for key in ("sekrit-1", "sekrit-2"):
            ok = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
    assert "sekrit" not in api_stack.procs.log("api-keys")


async def test_a_request_whose_last_runner_stops_gets_503_not_a_hang(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    """The projection says a runner is Ready (as a runner would report it), so the request is
    accepted; nothing pulls its task, and then the runner stops. The API gives up within a few
    seconds with 503, and cancels the task so that no runner serves it later."""
    api_stack.procs.start(
        "planner", "planner", "--nats", api_stack.nats_url, "--db", api_stack.db_url
    )
    await _cluster(js)
    pub = Publisher(js)
    await pub.publish(InstanceRequested(instance_id="i", model_id="m", origin="test"))
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        inst = await _until(client, "/v1/instances/i", lambda b: b.get("status") == "placed")
        runner = inst["shards"][0]["runner_id"]
        await pub.publish(
            RunnerStateChanged(
                runner_id=runner, instance_id="i", node_id="n1", state="Ready", origin="n1"
            )
        )
        await _until(client, "/v1/instances/i", lambda b: b["shards"][0]["state"] == "Ready")
        asked = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        cancels = await js.subscribe("shoal.events.task.m.*.TaskCancelled")
        await asyncio.sleep(0.5)
        assert not asked.done()  # accepted, waiting for a runner
        await pub.publish(
            RunnerStateChanged(
                runner_id=runner, instance_id="i", node_id="n1", state="Stopped", origin="n1"
            )
        )
        err = _error(await asyncio.wait_for(asked, 10), 503)
        assert (
            "runners: Stopped" in err["message"]
            and "then its last runner stopped" in (err["message"])
        )
        cancel = parse_event((await cancels.next_msg(timeout=5)).data)
        assert isinstance(cancel, TaskCancelled) and "runners: Stopped" in cancel.reason


async def test_model_names_aliases_default_cors_and_health(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    await _cluster(js)
    await Publisher(js).publish(
        InstanceRequested(instance_id="m-1", model_id="m", origin="test", aliases=["from-instance"])
    )
    url = api_stack.start_api(
        "named", "--alias", "gpt-x=m", "--api-key", "k1", "--cors-origin", "https://app.example"
    )
    await wait_healthy(url)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await client.get("/health")).json()["status"] == "ok"
        # Anthropic's SDK sends its key as x-api-key.
        assert (await client.get("/v1/models", headers={"x-api-key": "wrong"})).status_code == 401
        client.headers.update({"x-api-key": "k1"})
        body = await _until(client, "/v1/models", lambda b: len(_added(b)) == 3)
        assert {m["id"]: m.get("alias_of") for m in body["data"] if m["added"]} == {
            "m": None,
            "gpt-x": "m",
            "from-instance": "m",
        }
        assert (await client.get("/v1/models/gpt-x")).json()["alias_of"] == "m"
        _error(await client.get("/v1/models/nope"), 404)

        # No model, an alias, an instance's alias, `:latest`: all mean `m` (503: no runner).
        for named in ({}, {"model": "gpt-x"}, {"model": "from-instance"}, {"model": "m:latest"}):
            body = {"messages": CHAT["messages"]} | named
            err = _error(await client.post("/v1/chat/completions", json=body), 503)
            assert "model `m` cannot answer now" in err["message"], err

        await Publisher(js).publish(
            ModelAdded(model_id="m2", origin="test", n_layers=10, size_bytes=MiB)
        )
        await Publisher(js).publish(
            InstanceRequested(instance_id="m2-1", model_id="m2", origin="test")
        )
        await _until(client, "/v1/models", lambda b: len(_added(b)) == 4)
        await asyncio.sleep(1.1)  # the names read a moment ago are forgotten
        err = _error(
            await client.post("/v1/chat/completions", json={"messages": CHAT["messages"]}), 400
        )
        assert err["param"] == "model" and "m, m2" in err["message"], err

        # A browser page of the allowed origin may call; another origin's preflight fails.
        preflight = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        ok = await client.options(
            "/v1/chat/completions", headers={"Origin": "https://app.example"} | preflight
        )
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = await client.options(
            "/v1/chat/completions", headers={"Origin": "https://evil.example"} | preflight
        )
        assert "access-control-allow-origin" not in other.headers
        plain = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert plain.headers["access-control-allow-origin"] == "https://app.example"
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=30) as client:
        # Without --cors-origin, no CORS headers at all (the dashboard is same-origin).
        r = await client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers
