"""The runner process's edges, on a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.events import RunnerStateChanged, ShardAssignment
from services.runner.main import run_runner
from services.runner.spec import RunnerSpec
from tests.services.event_log import EventLog


async def test_a_pipeline_shard_fails_visibly(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    log = await EventLog().start(js)
    shard = ShardAssignment(runner_id="r1", node_id="n", rank=1, world_size=2, start_layer=15,
                            end_layer=30, n_layers=30)  # fmt: skip
    spec = RunnerSpec(nats_url=nats_server.url, node_id="n", instance_id="i", model_id="m",
                      shard=shard, cache_dir=str(tmp_path))  # fmt: skip
    assert await run_runner(spec, asyncio.Event()) == 1
    failed = await log.wait_for(RunnerStateChanged, lambda e: e.state == "Failed", timeout=10)
    assert failed.error is not None and "shard 2 of 2 (layers 15-29)" in failed.error
    await log.stop()
