"""MLX models served by real `shoal runner` processes on a real nats-server: a whole model, and
a 2-rank ring whose ranks find each other through the log."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.events import (
    ChatMessage,
    RunnerStateChanged,
    SamplingParams,
    TaskCompleted,
    TaskCreated,
)
from bus.publisher import Publisher
from services.runner.engines.mlx import MlxEngine
from services.runner.generation import Step, check_request, steps
from services.runner.spec import RunnerSpec
from tests.services.event_log import EventLog
from tests.services.processes import Processes
from tests.services.runner.engines.pipeline_head import decoding_of, prompt_of
from tests.services.runner.stages import stages

pytestmark = pytest.mark.slow

N_CTX = 256


def task(n: int, text: str) -> TaskCreated:
    return TaskCreated(
        task_id=f"t{n}", model_id="m", origin="test",
        messages=[ChatMessage(role="user", content=text)],
        params=SamplingParams(temperature=0.0, max_tokens=20),
    )  # fmt: skip


def reference(model: Path, t: TaskCreated) -> list[int]:
    engine = MlxEngine(model, n_ctx=N_CTX)
    engine.load()
    prompt = prompt_of(engine, t)
    limit = check_request(len(prompt), t.params, engine.n_ctx)
    return [s.token_id for s in steps(engine, prompt, decoding_of(t), limit, lambda: False)
            if isinstance(s, Step) and s.token_id is not None]  # fmt: skip


@pytest.mark.parametrize("bounds", [(0, 4), (0, 2, 4)], ids=["whole", "two-ranks"])
async def test_mlx_runners_answer_token_for_token_as_one_process(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path, tiny_mlx: Path,
    bounds: tuple[int, ...],
) -> None:  # fmt: skip
    tasks = [task(1, "hello there"), task(2, "tell me a story")]
    expected = [reference(tiny_mlx, t) for t in tasks]
    pipeline = stages(*bounds)
    log = await EventLog().start(js)
    with Processes(tmp_path / "logs") as procs:
        for shard in pipeline:
            spec = RunnerSpec(
                nats_url=nats_server.url, node_id=shard.node_id, instance_id="i", model_id="m",
                shard=shard, engine="mlx", model_path=str(tiny_mlx), n_ctx=N_CTX,
                cache_dir=str(tmp_path / shard.node_id),
                peers=[s for s in pipeline if s is not shard], peer_timeout_s=60,
            )  # fmt: skip
            procs.start(shard.runner_id, "runner", "--spec", spec.model_dump_json())
        for shard in pipeline:
            ready = await log.wait_for(
                RunnerStateChanged,
                lambda e, r=shard.runner_id: e.runner_id == r and e.state == "Ready",  # type: ignore[misc]
                timeout=60,
            )
            # Ring members say where they listen (the data-plane address only).
            assert (ready.endpoint is not None) == (len(pipeline) > 1 and shard.rank > 0)
        publisher = Publisher(js)
        for t, want in zip(tasks, expected, strict=True):
            await publisher.publish(t)
            chunks = await log.wait_chunks(t.task_id, timeout=60)
            assert [c.token_id for c in chunks if c.token_id is not None] == want
            await log.wait_for(TaskCompleted, lambda e, t=t: e.task_id == t.task_id)  # type: ignore[misc]
        assert len(want) == 20
    await log.stop()
