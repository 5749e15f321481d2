"""Reranking end to end: `shoal up --no-model` (one machine: NATS, projector, planner, worker,
API), a reranker added with `shoal models add`, then `POST /v1/rerank` and `POST /rerank`,
which load its rerank instance on demand (as embeddings do) and answer from its runner; and
the refusals, against an API with no runner at all.

No real reranker runs here: no reranker GGUF can be had offline, so the model is a tiny BERT
cross-encoder with random weights and rank pooling written by the test
(``harness/models/tiny_reranker.py``): its scores are deterministic
and meaningless, and only the path (request, on-demand load, task, runner, answer) is
tested."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from nats.js import JetStreamContext

from bus.embedded import free_port
from bus.publisher import Publisher
from events.catalogue import InstanceRequested, ModelAdded
from harness.models.tiny_reranker import write_tiny_reranker
from harness.processes import SHOAL
from harness.shoal_up import Drained, read_until_ready, start
from tests.api.conftest import ApiStack
from tests.cli.shoal_up import KEY

pytestmark = pytest.mark.slow

MODEL = "tiny-reranker"
UP_FLAGS = ["--api-key", KEY, "--no-model", "--runner-threads", "1"]
QUERY = "where does the cat sit?"
DOCS = [
    "the cat sat on the mat.",
    "stock markets fell sharply on monday.",
    {"text": "a kitten is sleeping on the rug."},
]


def add_model(nats_url: str, gguf: Path, cache: Path) -> None:
    argv = [SHOAL, "models", "add", MODEL, "--path", str(gguf), "--nats", nats_url]
    done = subprocess.run(
        [*argv, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr


async def test_a_rerank_request_loads_the_reranker_and_ranks(tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    up = start([SHOAL, "up", "--data-dir", str(tmp_path / "data"), "--port", str(port), *UP_FLAGS])
    lines = await read_until_ready(up)
    drained = Drained(up)
    try:
        nats_url = next(x for x in lines if x.startswith("NATS")).split()[1]
        gguf = write_tiny_reranker(tmp_path / "tiny-reranker.gguf")
        await asyncio.to_thread(add_model, nats_url, gguf, tmp_path / "cache")
        headers = {"Authorization": f"Bearer {KEY}"}
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=180) as c:
            # Nothing serves it: the request loads a rerank instance, then is answered.
            body = {"model": MODEL, "query": QUERY, "documents": DOCS}
            r = await c.post("/v1/rerank", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["model"] == MODEL and got["object"] == "list"
            assert got["id"].startswith("rerank-")
            results = got["results"]
            assert sorted(x["index"] for x in results) == [0, 1, 2]
            scores = [x["relevance_score"] for x in results]
            assert scores == sorted(scores, reverse=True) and len(set(scores)) == 3
            assert all("document" not in x for x in results)
            assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 3 * 8
            # The same route without /v1, the top one with its text: the same scores.
            top = await c.post("/rerank", json=body | {"top_n": 1, "return_documents": True})
            assert top.status_code == 200, top.text
            first = top.json()["results"]
            assert first[0]["index"] == results[0]["index"]
            assert first[0]["relevance_score"] == pytest.approx(scores[0], abs=1e-5)
            doc = DOCS[results[0]["index"]]
            assert first[0]["document"] == {"text": doc if isinstance(doc, str) else doc["text"]}
            assert len(first) == 1
            # The instance it loaded: on demand, role rerank.
            listed = (await c.get("/v1/instances")).json()
            rows = listed["data"] if isinstance(listed, dict) else listed
            mine = [i for i in rows if i["model_id"] == MODEL]
            assert [(i["role"], i["on_demand"]) for i in mine] == [("rerank", True)]
            # A document too long for the instance's context (the model's own 256 tokens, less
            # than a rerank instance's default 512): a clear 400.
            long = await c.post("/v1/rerank", json=body | {"documents": ["cat " * 600]})
            assert long.status_code == 400, long.text
            said = long.json()["error"]["message"]
            assert "document 0 with the query is" in said
            assert "more than the 256 this rerank instance takes" in said
    finally:
        drained.stop()


async def test_refusals_in_openai_s_error_shape(api_stack: ApiStack, js: JetStreamContext) -> None:
    """Instances as the log holds them (no runner is needed for the refusals)."""
    ask = {"model": "chatty", "query": "q", "documents": ["d"]}
    pub = Publisher(js)
    await pub.publish(ModelAdded(model_id="chatty", origin="test", n_layers=30, size_bytes=10**8))
    await pub.publish(InstanceRequested(instance_id="c", model_id="chatty", origin="t"))
    async with httpx.AsyncClient(base_url=api_stack.url) as c:
        for _ in range(100):  # until the projector has the instance
            r = await c.post("/v1/rerank", json=ask)
            if r.status_code == 400:
                break
            await asyncio.sleep(0.1)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "model_not_reranker", r.text
        assert "served for chat only, not for reranking" in error["message"]
        assert 'POST /v1/instances {"model": "chatty", "role": "rerank"}' in error["message"]
        empty = await c.post("/rerank", json={"model": "chatty", "query": "q", "documents": []})
        assert empty.status_code == 400
        assert empty.json()["error"]["type"] == "invalid_request_error"
        assert "documents is an empty list" in empty.json()["error"]["message"]
        fields = {"model": "chatty", "query": "q", "documents": ["d"], "rank_fields": ["t"]}
        r = await c.post("/v1/rerank", json=fields)
        assert r.status_code == 400 and "`rank_fields` is not supported" in r.text
        r = await c.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]})
        assert r.status_code == 404, r.text
        # More than a NATS message may hold: refused before anything is published.
        huge = ask | {"documents": ["x" * (1024**2 + 10)]}
        r = await c.post("/v1/rerank", json=huge)
        assert r.status_code == 413 and r.json()["error"]["param"] == "documents", r.text
