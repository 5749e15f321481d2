"""Keys with roles, owners and limits, end to end: keys made with `shoal keys add` on the log of
the session's `shoal up` (which has an admin key of its own), used through the real SDKs."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import openai
import pytest

from harness.processes import SHOAL
from tests.api.up_cluster import UpCluster

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class MadeKey:
    key: str
    key_id: str
    name: str


def shoal_keys(cluster: UpCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHOAL, "keys", *args, "--db", cluster.db_url],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 20) -> None:
    async with asyncio.timeout(within_s):
        while not await check():
            await asyncio.sleep(0.1)


async def add_key(cluster: UpCluster, role: str = "user", *limits: str) -> MadeKey:
    """A new key, once the API takes it (the projector has its row)."""
    name = f"{role}-{uuid.uuid4().hex[:8]}"
    made = await asyncio.to_thread(
        shoal_keys, cluster, "add", name, "--role", role, "--nats", cluster.nats_url, *limits
    )
    key = made.stdout.strip()
    found = re.search(r"\(key (\S+),", made.stderr)
    assert key.startswith("sk-shoal-") and found is not None, made

    async def taken() -> bool:
        async with httpx.AsyncClient() as http:
            r = await http.get(f"{cluster.base}/v1/models", headers=_bearer(key))
        return r.status_code == 200

    await eventually(taken, f"key {name} taken")
    return MadeKey(key, found.group(1), name)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _client(cluster: UpCluster, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key=key, max_retries=0)


async def test_a_user_key_runs_inference_and_not_the_cluster(up_cluster: UpCluster) -> None:
    user = await add_key(up_cluster)
    admin = await add_key(up_cluster, "admin")
    reply = await _client(up_cluster, user.key).chat.completions.create(
        model=up_cluster.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    async with httpx.AsyncClient(base_url=up_cluster.base, timeout=30) as http:
        state = await http.get("/v1/state", headers=_bearer(user.key))
        assert state.status_code == 403
        error = state.json()["error"]  # OpenAI's shape
        assert error["code"] == "permission_denied" and "admin" in error["message"]
        pull = await http.post(
            "/api/pull", json={"model": up_cluster.model}, headers=_bearer(user.key)
        )
        assert pull.status_code == 403 and isinstance(pull.json()["error"], str)  # Ollama's
        events = await http.get("/v1/events", headers={"x-api-key": user.key})
        assert events.status_code == 403
        assert (await http.get("/v1/state", headers=_bearer(admin.key))).status_code == 200
        assert (await http.get("/metrics", headers=_bearer(admin.key))).status_code == 200
        assert (await http.get("/healthz")).status_code == 200  # public
        assert (await http.get("/v1/models")).status_code == 401
        wrong = await http.get("/v1/models", headers={b"Authorization": "Bearer café".encode()})
        assert wrong.status_code == 401  # not ASCII: a key that opens nothing, not a 500


async def test_a_stored_response_is_its_owners(up_cluster: UpCluster) -> None:
    alice, bob = await add_key(up_cluster), await add_key(up_cluster)
    made = await _client(up_cluster, alice.key).responses.create(
        model=up_cluster.model, input="Say hi.", max_output_tokens=4, store=True
    )
    as_bob = _client(up_cluster, bob.key)
    with pytest.raises(openai.NotFoundError):
        await as_bob.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await as_bob.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError):
        await as_bob.responses.create(
            model=up_cluster.model, input="And?", previous_response_id=made.id, max_output_tokens=4
        )
    with pytest.raises(openai.NotFoundError):
        await as_bob.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await as_bob.responses.cancel(made.id)
    assert (await _client(up_cluster, alice.key).responses.retrieve(made.id)).id == made.id
    # The API's own key is an admin's: it sees every key's.
    assert (await _client(up_cluster, up_cluster.key).responses.retrieve(made.id)).id == made.id


async def test_limits_usage_and_revoking(up_cluster: UpCluster) -> None:
    limited = await add_key(up_cluster, "user", "--requests-per-minute", "1")
    client = _client(up_cluster, limited.key)
    await client.chat.completions.create(
        model=up_cluster.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(
            model=up_cluster.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
    assert 0 < int(refused.value.response.headers["retry-after"]) <= 60

    async def counted() -> bool:
        listed = await asyncio.to_thread(shoal_keys, up_cluster, "list", "--json")
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        mine = next(r for r in rows if r["key_id"] == limited.key_id)
        return bool(mine["requests"] == 1 and mine["completion_tokens"] > 0)

    await eventually(counted, "usage projected")
    async with httpx.AsyncClient(base_url=up_cluster.base) as http:
        metrics = (await http.get("/metrics", headers=_bearer(up_cluster.key))).text
    assert f'shoal_key_requests_total{{key="{limited.name}",model="{up_cluster.model}"}} 1.0' in (
        metrics
    )
    await asyncio.to_thread(
        shoal_keys, up_cluster, "revoke", limited.name, "--nats", up_cluster.nats_url
    )

    async def refused_now() -> bool:
        async with httpx.AsyncClient() as http:
            r = await http.get(f"{up_cluster.base}/v1/models", headers=_bearer(limited.key))
        return r.status_code == 401

    await eventually(refused_now, "revoked")


async def test_embeddings_take_the_same_gate_as_chat(up_cluster: UpCluster) -> None:
    """Once, embeddings (and rerank) skipped the per-key limits, admission and usage: a key
    limited to 2 requests a minute sent any number, and `shoal keys list` showed none."""
    limited = await add_key(up_cluster, "user", "--requests-per-minute", "2")
    client = _client(up_cluster, limited.key)
    for _ in range(2):
        made = await client.embeddings.create(model=up_cluster.model, input=["a cat", "a dog"])
        assert len(made.data) == 2
    with pytest.raises(openai.RateLimitError) as refused:
        await client.embeddings.create(model=up_cluster.model, input="a cat")
    assert 0 < int(refused.value.response.headers["retry-after"]) <= 60
    async with httpx.AsyncClient(base_url=up_cluster.base) as http:  # Ollama's: the same key
        r = await http.post(
            "/api/embed",
            json={"model": up_cluster.model, "input": "x"},
            headers=_bearer(limited.key),
        )
        assert r.status_code == 429, r.text

    async def counted() -> bool:
        listed = await asyncio.to_thread(shoal_keys, up_cluster, "list", "--json")
        mine = next(
            row
            for row in map(json.loads, listed.stdout.splitlines())
            if row["key_id"] == limited.key_id
        )
        return bool(mine["requests"] == 2 and mine["prompt_tokens"] > 0)

    await eventually(counted, "the embeddings' usage projected")
    async with httpx.AsyncClient(base_url=up_cluster.base) as http:
        metrics = (await http.get("/metrics", headers=_bearer(up_cluster.key))).text
        admitted = (await http.get("/v1/admission", headers=_bearer(up_cluster.key))).json()
    assert f'shoal_key_requests_total{{key="{limited.name}",model="{up_cluster.model}"}} 2.0' in (
        metrics
    )
    assert f"{up_cluster.model} (embed)" in [m["model"] for m in admitted["models"]]


async def test_a_user_key_does_not_change_the_cluster(up_cluster: UpCluster) -> None:
    """Unloading (keep_alive 0), pinning (keep_alive -1) and downloading a model are an
    admin's (`--on-demand admins`, the default): a user key gets a 403 saying so."""
    user = await add_key(up_cluster, "user")
    async with httpx.AsyncClient(base_url=up_cluster.base, timeout=30) as http:
        asks = [
            ("/api/generate", {"model": up_cluster.model, "keep_alive": 0}),
            ("/api/chat", {"model": up_cluster.model, "messages": [], "keep_alive": -1}),
            ("/api/generate", {"model": up_cluster.model, "prompt": "Hi", "keep_alive": "-1m"}),
            ("/api/generate", {"model": up_cluster.model, "prompt": "Hi", "keep_alive": 0}),
            (
                "/api/chat",
                {"model": "llama3.3-70b", "messages": [{"role": "user", "content": "x"}]},
            ),
        ]
        for path, body in asks:
            r = await http.post(path, json=body, headers=_bearer(user.key))
            assert r.status_code == 403, (body, r.text)
            assert "an admin must" in r.json()["error"], r.text
        r = await http.get("/api/ps", headers=_bearer(user.key))
        assert up_cluster.model in r.text  # still loaded
        # What a user key may not download is not listed to it as askable; an admin's is.
        for route in ("/api/tags", "/v1/models"):
            assert "llama3.3-70b" not in (await http.get(route, headers=_bearer(user.key))).text
            listed = await http.get(route, headers=_bearer(up_cluster.key))
            assert "llama3.3-70b" in listed.text
        state = (await http.get("/v1/state", headers=_bearer(up_cluster.key))).json()
        assert "llama3.3-70b" not in json.dumps(state["models"])  # nothing was added
