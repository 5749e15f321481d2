"""An MLX model split across nodes: the runner's side of ``engines/mlx/pipeline.py``.

mlx's ring needs every rank's address before any rank can join it. Each stage takes a free
port on its node's data-plane address and reports it (``Loading`` with ``endpoint``), waits
until every other stage of the pipeline has reported one, loads its layers and joins the ring.
Rank 0 then serves tasks with the pipeline as its engine (``slots`` at once); the other ranks
follow it until the head shuts the pipeline down or the ring breaks, when they exit and are
restarted (the whole ring forms again).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from inference.engines.llamacpp import rpc as ggml_rpc
from inference.engines.mlx.follower import PipelineFollower
from inference.engines.mlx.head import PipelineHead
from inference.engines.mlx.ring import PipelineShard
from services.runner.peers import Peers
from services.runner.spec import RunnerSpec
from services.runner.state_reporter import StateReporter

log = logging.getLogger(__name__)

# How long a rank waits in mlx for its neighbours to join the ring, once it has their addresses.
RING_TIMEOUT_S = 60.0


async def ring_shard(spec: RunnerSpec, peers: Peers, state: StateReporter) -> PipelineShard:
    """Report this stage's address, wait for every other stage's: the ring's addresses."""
    own = ggml_rpc.free_endpoint(spec.data_host)
    await state.report("Loading", progress=0.0, endpoint=own)
    endpoints = await peers.wait_endpoints(spec.peer_timeout_s)
    by_rank = {p.rank: e for p, e in zip(spec.peers, endpoints, strict=True)} | {
        spec.shard.rank: own
    }
    s = spec.shard
    hosts = tuple(by_rank[r] for r in range(s.world_size))
    return PipelineShard(s.rank, s.world_size, s.start_layer, s.end_layer, s.n_layers, hosts)


async def load_head(model: Path, spec: RunnerSpec, shard: PipelineShard) -> PipelineHead:
    head = PipelineHead(
        model, shard, n_ctx=spec.n_ctx, slots=spec.slots, connect_timeout=RING_TIMEOUT_S
    )
    await asyncio.to_thread(head.load)
    return head


async def follow(
    model: Path, spec: RunnerSpec, shard: PipelineShard, state: StateReporter, stop: asyncio.Event
) -> None:
    """A later rank: join the ring, then take part in every generation until the head shuts
    the pipeline down (or asked to stop). Raises ``PipelineBroken`` when the ring breaks."""
    follower = PipelineFollower(model, shard, connect_timeout=RING_TIMEOUT_S)
    await asyncio.to_thread(follower.load)
    await state.report("Ready", progress=1.0, endpoint=shard.hosts[shard.rank])
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[bool] = loop.create_future()

    def run() -> None:
        try:
            follower.follow()
            loop.call_soon_threadsafe(ended.set_result, True)
        except BaseException as exc:
            loop.call_soon_threadsafe(ended.set_exception, exc)

    # follow() cannot be interrupted: a daemon thread, which ends with the process.
    threading.Thread(target=run, name="mlx-follow", daemon=True).start()
    halt: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ended, halt], return_when=asyncio.FIRST_COMPLETED)
    halt.cancel()
    if ended.done():
        ended.result()  # raises PipelineBroken when the ring broke
        log.info("the pipeline was shut down by its head")
