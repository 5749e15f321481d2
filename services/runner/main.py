"""The runner process: one shard of one instance. Started and watched by its worker.

It reports every state change as ``RunnerStateChanged``: Downloading (with progress) when the
weights must be fetched, Loading, Ready; Running while it serves a task; Stopped on a clean
exit; Failed, with the error, when it cannot go on (it then exits non-zero and its worker
decides about a restart).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from bus.connection import connect
from bus.streams import ensure_streams
from services.models.cards import card_for
from services.models.resolve import resolve_model
from services.runner.engines.llamacpp import LlamaCppEngine
from services.runner.serve import RunnerIdentity, StateReporter, TaskServer
from services.runner.spec import RunnerSpec

log = logging.getLogger(__name__)


class UnsupportedShard(RuntimeError):
    """A shard this runner cannot serve (a stage of a pipeline across nodes)."""


async def model_path(spec: RunnerSpec, state: StateReporter) -> Path:
    if spec.model_path is not None:
        return Path(spec.model_path)
    loop = asyncio.get_running_loop()

    def on_progress(fraction: float) -> None:
        # Called from the download thread, already at most once a second (resolve_model).
        asyncio.run_coroutine_threadsafe(
            state.report("Downloading", progress=round(fraction, 4)), loop
        )

    card = card_for(spec.model_id)
    return await asyncio.to_thread(resolve_model, card, Path(spec.cache_dir), on_progress)


async def run_runner(spec: RunnerSpec, stop: asyncio.Event) -> int:
    nc = await connect(spec.nats_url, name=f"shoal-runner-{spec.runner_id}")
    me = RunnerIdentity(spec.runner_id, spec.instance_id, spec.model_id, spec.node_id)
    if spec.engine != "llamacpp":
        raise SystemExit(f"engine {spec.engine!r} is not available in this runner")
    state = StateReporter(nc, me)
    await ensure_streams(nc.jetstream())
    try:
        if spec.shard.world_size > 1:
            # Placement already splits models that fit no single node; serving such a split
            # (llama.cpp RPC, MLX ring) is the next step. Until then, fail visibly rather than
            # load the whole model on a node that was given only part of it.
            raise UnsupportedShard(
                f"this runner serves whole models only; shard {spec.shard.rank + 1} of"
                f" {spec.shard.world_size} (layers {spec.shard.start_layer}-"
                f"{spec.shard.end_layer - 1}) needs pipeline support"
            )
        path = await model_path(spec, state)
        await state.report("Loading", progress=0.0)
        engine = LlamaCppEngine(
            path, n_ctx=spec.n_ctx, chat_format=spec.chat_format, n_threads=spec.n_threads
        )
        await asyncio.to_thread(engine.load)
        server = TaskServer(nc, engine, me)
        await server.start()
        await state.report("Ready", progress=1.0)
        await server.serve_forever(stop)
        await state.report("Stopped")
        return 0
    except Exception as exc:
        log.exception("runner %s failed", spec.runner_id)
        await state.report("Failed", error=f"{type(exc).__name__}: {exc}", exit_code=1)
        return 1
    finally:
        await nc.drain()
