"""The runner process: one shard of one instance. Started and watched by its worker.

It reports every state change as ``RunnerStateChanged``: Downloading (with progress) when the
weights must be fetched, Loading, Ready; Running while it serves a task; Stopped on a clean
exit; Failed, with the error, when it cannot go on (it then exits non-zero and its worker
decides about a restart).

A shard that is one stage of a pipeline across nodes waits for the other stages first:
``llamacpp_pipeline.py`` (llama.cpp RPC) and ``mlx_stages.py`` (MLX ring) say how.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from bus.connection import connect
from bus.streams import ensure_streams
from events.kinds import DEFAULT_KV_CACHE
from events.records import ShardAssignment, Speculative
from inference.embedding import Embedder
from inference.engines.base import Engine, EngineBroken
from inference.offload import accelerators, llama_offload, mlx_device, offload_problem
from inference.speculative import NgramLookup
from services.runner.embed_serve import EmbeddingServer, RerankServer
from services.runner.peers import PeerLost, Peers, StopWhileWaiting
from services.runner.serve import TaskPuller, TaskServer
from services.runner.spec import RunnerSpec
from services.runner.state_reporter import RunnerIdentity, StateReporter
from services.runner.tokenizer_service import TokenizerService

log = logging.getLogger(__name__)


class UnsupportedEngine(RuntimeError):
    """A model for an engine this runner does not have."""


class UnsupportedDevice(RuntimeError):
    """A shard placed on an accelerator its engine here cannot use."""


def use_mlx_device(shard: ShardAssignment) -> None:
    """MLX's default device for the whole process: the GPU (Metal, or MLX's CUDA) for a shard
    on an accelerator, else the CPU (where a Mac's GPU would otherwise take it)."""
    import mlx.core as mx

    if mlx_device(shard) == "cpu":
        mx.set_default_device(mx.cpu)
        return
    if not (mx.metal.is_available() or mx.cuda.is_available()):
        raise UnsupportedDevice(f"placed on {shard.device}, but MLX has no GPU here")
    mx.set_default_device(mx.gpu)


def preload() -> None:
    """Import what serving a llama.cpp model needs before a spec is read (a worker's warm
    spare): its engine and what fetches its weights."""
    import inference.engines.llamacpp.engine  # noqa: F401
    import services.runner.weights  # noqa: F401


async def model_path(spec: RunnerSpec, state: StateReporter, nc: Client) -> Path:
    # Imported here: it reads the model cards and the GGUF metadata, which a runner that
    # serves a later llama.cpp stage never needs.
    from services.runner.weights import shard_weights

    return await shard_weights(spec, nc, state)


async def projector_path(spec: RunnerSpec, nc: Client) -> Path | None:
    from services.runner.weights import shard_projector

    return await shard_projector(spec, nc)


async def run_runner(spec: RunnerSpec, stop: asyncio.Event) -> int:
    nc = await connect(spec.nats_url, name=f"shoal-runner-{spec.runner_id}")
    me = RunnerIdentity(spec.runner_id, spec.instance_id, spec.model_id, spec.node_id)
    state = StateReporter(nc, me)
    await ensure_streams(nc.jetstream())
    peers = Peers(nc.jetstream(), spec.peers, stop)
    try:
        await peers.start()
        if spec.engine == "llamacpp":
            await run_llamacpp(spec, nc, me, state, peers, stop)
        elif spec.engine == "mlx":
            await run_mlx(spec, nc, me, state, peers, stop)
        elif spec.engine == "diffusers":
            if importlib.util.find_spec("diffusers") is None:
                raise UnsupportedEngine(
                    "an image model's runner needs diffusers and PyTorch: install Shoal with"
                    " its images extra (pip install -e '.[images]')"
                )
            from services.runner.image_serve import run_diffusers

            await run_diffusers(spec, nc, me, state, stop)
        else:
            raise UnsupportedEngine(f"engine {spec.engine!r} is not available in this runner")
        await state.report("Stopped")
        return 0
    except StopWhileWaiting:  # asked to stop before the pipeline formed
        await state.report("Stopped")
        return 0
    except Exception as exc:
        log.exception("runner %s failed", spec.runner_id)
        await state.report("Failed", error=f"{type(exc).__name__}: {exc}", exit_code=1)
        return 1
    finally:
        await peers.stop()
        await nc.drain()


async def run_llamacpp(
    spec: RunnerSpec,
    nc: Client,
    me: RunnerIdentity,
    state: StateReporter,
    peers: Peers,
    stop: asyncio.Event,
) -> None:
    """A whole model, or a pipeline's head (its later stages on their RPC servers), or a later
    stage (an RPC server; the head sends it its layers)."""
    # Engines are imported where used: every `shoal` command imports this module, and
    # llama_cpp or mlx_lm (with transformers) take seconds to import.
    from inference.engines.llamacpp.engine import LlamaCppEngine
    from services.runner.pipelines.llamacpp import connect_stages, serve_stage

    if spec.shard.world_size > 1 and spec.kv_cache != DEFAULT_KV_CACHE:
        # (placement refuses it: flash attention, which a quantized cache needs, stays off
        # across stages)
        raise UnsupportedEngine(f"kv_cache {spec.kv_cache}: a pipeline keeps an f16 KV cache")
    if spec.shard.rank > 0:
        await serve_stage(spec, state, stop)
        return
    if spec.peers:
        offload = await connect_stages(spec, peers, state)
    else:
        offload = await asyncio.to_thread(whole_model_offload, spec.shard)
    path = await model_path(spec, state, nc)
    await state.report("Loading", progress=0.0)
    if spec.role != "chat" and spec.kv_cache != DEFAULT_KV_CACHE:
        raise UnsupportedEngine(f"kv_cache {spec.kv_cache}: a {spec.role} runner keeps f16 only")
    if spec.role == "embed":
        from inference.engines.llamacpp.embed import LlamaCppEmbedder

        embedder = LlamaCppEmbedder(path, n_ctx=spec.n_ctx, n_threads=spec.n_threads, **offload)
        await asyncio.to_thread(embedder.load)
        await serve_embeddings(spec, nc, me, embedder, state, peers, stop)
        return
    if spec.role == "rerank":
        from inference.engines.llamacpp.rerank import LlamaCppReranker

        reranker = LlamaCppReranker(path, n_ctx=spec.n_ctx, n_threads=spec.n_threads, **offload)
        await asyncio.to_thread(reranker.load)
        await _serve(RerankServer(nc, reranker, me, _task_file(spec)), state, peers, stop)
        return
    engine = LlamaCppEngine(
        path,
        n_ctx=spec.n_ctx,
        slots=spec.slots,
        chat_format=spec.chat_format,
        n_threads=spec.n_threads,
        projector=await projector_path(spec, nc),
        # A pipeline's head keeps its own layers on its CPU; libmtmd's GPU would be the first
        # GPU device it finds, a later stage's RPC server on a head without a GPU of its own.
        projector_on_cpu=bool(spec.peers),
        kv_cache=spec.kv_cache,
        speculative=ngram_lookup(spec.speculative),
        **offload,
    )
    await asyncio.to_thread(engine.load)
    await serve_tasks(spec, nc, me, engine, state, peers, stop)
    if not spec.peers:  # (a pipeline's head must not free a model whose stages may be gone)
        await asyncio.to_thread(engine.unload)


def ngram_lookup(asked: Speculative | None) -> NgramLookup | None:
    """The engine's prompt lookup, as the instance asked for it."""
    if asked is None:
        return None
    return NgramLookup(n_max=asked.ngram_max, n_min=asked.ngram_min, draft_max=asked.draft_max)


def whole_model_offload(shard: ShardAssignment) -> dict[str, Any]:
    """``Llama``'s arguments that put the shard where it was placed; ``UnsupportedDevice``
    when llama.cpp here does not offer its accelerators."""
    if accelerators(shard):
        from inference.engines.llamacpp.devices import list_devices

        problem = offload_problem(shard, list_devices())
        if problem is not None:
            raise UnsupportedDevice(problem)
    offload = llama_offload(shard)
    log.info("layers %s: %s", shard.device_layers(), offload)
    return offload


async def run_mlx(
    spec: RunnerSpec,
    nc: Client,
    me: RunnerIdentity,
    state: StateReporter,
    peers: Peers,
    stop: asyncio.Event,
) -> None:
    """A whole MLX model, or one rank of an MLX ring: the head serves, the others follow."""
    if spec.role != "chat":
        raise UnsupportedEngine(f"role {spec.role} is not supported on the mlx engine")
    if spec.kv_cache != DEFAULT_KV_CACHE:  # (placement refuses it; a spec by hand might not)
        raise UnsupportedEngine(f"kv_cache {spec.kv_cache}: the mlx engine keeps f16 only")
    if spec.speculative is not None:  # (the API refuses it)
        raise UnsupportedEngine("speculative: the mlx engine does not decode speculatively")
    from inference.engines.mlx.blas import blas_in_use, set_threads
    from inference.engines.mlx.engine import MlxEngine
    from services.runner.pipelines.mlx import follow, load_head, ring_shard

    use_mlx_device(spec.shard)
    if spec.n_threads is not None:
        set_threads(spec.n_threads)
    log.info("mlx multiplies with %s", blas_in_use())

    path = await model_path(spec, state, nc)
    if not spec.peers:
        await state.report("Loading", progress=0.0)
        engine = MlxEngine(path, n_ctx=spec.n_ctx, slots=spec.slots)
        await asyncio.to_thread(engine.load)
        try:
            await serve_tasks(spec, nc, me, engine, state, peers, stop)
        finally:
            await asyncio.to_thread(engine.close)
        return
    shard = await ring_shard(spec, peers, state)
    if shard.rank > 0:
        await follow(path, spec, shard, state, stop)
        return
    head = await load_head(path, spec, shard)
    try:
        await serve_tasks(spec, nc, me, head, state, peers, stop)
    finally:
        with contextlib.suppress(EngineBroken):
            await asyncio.to_thread(head.shutdown)


async def serve_tasks(
    spec: RunnerSpec,
    nc: Client,
    me: RunnerIdentity,
    engine: Engine,
    state: StateReporter,
    peers: Peers,
    stop: asyncio.Event,
) -> None:
    """Serve tasks with a loaded engine until asked to stop, or until a stage it depends on is
    lost (``PeerLost``); and answer questions about the model's tokenizer meanwhile (from
    before the runner is Ready)."""
    tokenizer = TokenizerService(nc, engine, spec.model_id)
    await tokenizer.start()
    try:
        await _serve(TaskServer(nc, engine, me, _task_file(spec)), state, peers, stop)
    finally:
        await tokenizer.stop()


async def serve_embeddings(
    spec: RunnerSpec,
    nc: Client,
    me: RunnerIdentity,
    embedder: Embedder,
    state: StateReporter,
    peers: Peers,
    stop: asyncio.Event,
) -> None:
    """An embed instance's: embeddings tasks, as ``serve_tasks`` serves generation ones."""
    await _serve(EmbeddingServer(nc, embedder, me, _task_file(spec)), state, peers, stop)


def _task_file(spec: RunnerSpec) -> Path | None:
    return Path(spec.task_file) if spec.task_file else None


async def _serve(
    server: TaskPuller, state: StateReporter, peers: Peers, stop: asyncio.Event
) -> None:
    await server.start()
    await state.report("Ready", progress=1.0, slots=server.slots)
    halt = asyncio.Event()
    watchers = [
        asyncio.create_task(_set_when(stop.wait(), halt)),
        asyncio.create_task(_set_when(peers.wait_lost(), halt)),
    ]
    try:
        await server.serve_forever(halt)
    finally:
        for w in watchers:
            w.cancel()
    if peers.lost is not None:
        raise PeerLost(f"another stage of the pipeline is gone: {peers.lost}")


async def _set_when(done: Awaitable[object], flag: asyncio.Event) -> None:
    await done
    flag.set()
