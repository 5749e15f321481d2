"""MLX models served by real `shoal runner` processes on a real nats-server: a whole model, and
a 2-rank ring whose ranks find each other through the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from events.catalogue import RunnerStateChanged, TaskCompleted, TaskCreated
from events.records import ChatMessage, ResponseFormat, SamplingParams, Tool, ToolChoice
from harness.processes import Processes
from inference.engines.mlx.engine import MlxEngine
from services.runner import RunnerSpec
from tests.inference.served import Served, calls_of, close, expected, published
from tests.services.event_log import EventLog
from tests.services.runner.stages import stages

pytestmark = pytest.mark.slow

N_CTX = 1024  # the tools described in a system message: ~400 of the tiny vocabulary's tokens


def task(n: int, text: str, max_tokens: int = 20, **fields: Any) -> TaskCreated:
    return TaskCreated(
        task_id=f"t{n}",
        model_id="m",
        origin="test",
        messages=[ChatMessage(role="user", content=text)],
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        **fields,
    )


SAY = Tool(name="say", parameters={"type": "object", "properties": {"word": {"type": "string"}}})
# Plain text, a required tool call, a reply in a JSON schema, log-probabilities: the same from
# a runner (whole or split) as from the engine in this process.
TASKS = [
    task(1, "hello there"),
    task(2, "tell me a story"),
    # The tiny vocabulary spells the call's JSON a character a token or so.
    task(3, "say hello", 60, tools=[SAY], tool_choice=ToolChoice(mode="required")),
    task(
        4,
        "a number",
        response_format=ResponseFormat(
            type="json_schema",
            json_schema={
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
            },
        ),
    ),
    task(5, "hello", logprobs=2),
]


def reference(model: Path) -> list[tuple[list[Served], list[float | None]]]:
    engine = MlxEngine(model, n_ctx=N_CTX)
    engine.load()
    return [expected(engine, t) for t in TASKS]


@pytest.mark.parametrize(
    ("bounds", "slots"),
    [((0, 4), 1), ((0, 4), 3), ((0, 2, 4), 1), ((0, 2, 4), 3)],
    ids=["whole", "whole-batched", "two-ranks", "two-ranks-batched"],
)
async def test_mlx_runners_answer_token_for_token_as_one_process(
    nats_server: EmbeddedNats,
    js: JetStreamContext,
    tmp_path: Path,
    tiny_mlx: Path,
    bounds: tuple[int, ...],
    slots: int,
) -> None:
    wanted = reference(tiny_mlx)
    pipeline = stages(*bounds)
    log = await EventLog().start(js)
    with Processes(tmp_path / "logs") as procs:
        for shard in pipeline:
            spec = RunnerSpec(
                nats_url=nats_server.url,
                node_id=shard.node_id,
                instance_id="i",
                model_id="m",
                shard=shard,
                engine="mlx",
                model_path=str(tiny_mlx),
                n_ctx=N_CTX,
                cache_dir=str(tmp_path / shard.node_id),
                peers=[s for s in pipeline if s is not shard],
                peer_timeout_s=60,
                slots=slots,
            )
            procs.start(shard.runner_id, "runner", "--spec", spec.model_dump_json())
        for shard in pipeline:
            ready = await log.wait_for(
                RunnerStateChanged,
                lambda e, r=shard.runner_id: e.runner_id == r and e.state == "Ready",  # type: ignore[misc]
                timeout=60,
            )
            # Ring members say where they listen (the data-plane address only).
            assert (ready.endpoint is not None) == (len(pipeline) > 1 and shard.rank > 0)
            assert ready.slots == (slots if shard.rank == 0 else None)
        publisher = Publisher(js)
        if slots > 1:  # all at once: decoded together, each as alone
            for t in TASKS:
                await publisher.publish(t)
        for t, (want, want_logprobs) in zip(TASKS, wanted, strict=True):
            if slots == 1:
                await publisher.publish(t)
            got, got_logprobs = published(await log.wait_chunks(t.task_id, timeout=60))
            assert got == want, t.task_id
            assert close(got_logprobs, want_logprobs, 1e-5), t.task_id
            await log.wait_for(TaskCompleted, lambda e, t=t: e.task_id == t.task_id)  # type: ignore[misc]
        # A prompt asked again starts from the cache the first asking left (a whole model's:
        # a ring keeps no prompt cache).
        for n in (6, 7):
            await publisher.publish(task(n, "what is the weather like?", 4))
            done = await log.wait_for(TaskCompleted, lambda e, n=n: e.task_id == f"t{n}")  # type: ignore[misc]
        assert done.usage.cached_tokens == (
            done.usage.prompt_tokens - 1 if len(pipeline) == 1 else 0
        )
    await log.stop()
    assert len(wanted[0][0]) == 21  # 20 tokens and the end
    # Random weights, constrained: a call of the tool offered, a reply that starts as JSON.
    assert calls_of(wanted[2][0])[0]["name"] == "say"
    assert "".join(text for _, text, _, _ in wanted[3][0]).startswith("{")
    assert all(v is not None for v in wanted[4][1][:-1])
