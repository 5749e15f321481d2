"""A GGUF model split across nodes with llama.cpp's RPC backend.

Every stage but the first runs a ggml RPC server on its node's data-plane address and reports
it (``Ready`` with ``endpoint``); it holds no model itself. The first stage, the head, waits
for them, registers them as devices and loads the model so that its own layers (and the
embeddings) stay in its memory and each later stage's layers, with their KV cache, go to that
stage's server. The head then serves tasks like a whole-model runner: llama.cpp sends the
hidden states from stage to stage for every token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

from events.records import ShardAssignment
from inference.engines.llamacpp import rpc as ggml_rpc
from inference.engines.llamacpp.layer_split import rpc_offload
from inference.offload import accelerators
from services.addresses import is_loopback
from services.runner.peers import Peers
from services.runner.spec import RunnerSpec
from services.runner.state_reporter import StateReporter

log = logging.getLogger(__name__)


class Unreachable(ConnectionError):
    """A stage's advertised endpoint cannot be reached from this node."""


def unreachable(spec: RunnerSpec, peer: ShardAssignment, endpoint: str) -> str:
    """Why a pipeline cannot form: which node cannot reach which, at what address."""
    host, _ = ggml_rpc.split_endpoint(endpoint)
    said = (
        f"node {spec.node_id} ({spec.data_host}) cannot reach stage {peer.rank + 1} of"
        f" {peer.world_size} on node {peer.node_id} at {endpoint}"
    )
    if is_loopback(host) and peer.node_id != spec.node_id:
        return said + (
            f": a loopback address, which only {peer.node_id}'s own machine reaches; give that"
            " node an address the others reach (`--data-host`, docs/operations.md#addresses)"
        )
    return said + ": nothing answered there within 5 s (a firewall, another network, or the node"
    " is gone)"


async def serve_stage(spec: RunnerSpec, state: StateReporter, stop: asyncio.Event) -> None:
    """A later stage: serve the device it was placed on (this node's CPU or a GPU) over RPC
    until asked to stop."""
    ggml_rpc.check_available()
    endpoint = ggml_rpc.free_endpoint(spec.data_host)
    threads = spec.n_threads or os.cpu_count() or 1
    cache = Path(spec.cache_dir) / "rpc-cache"
    failed = asyncio.Event()
    loop = asyncio.get_running_loop()

    on_gpu = bool(accelerators(spec.shard))

    def run() -> None:
        ggml_rpc.serve(endpoint, threads, cache, on_gpu)  # returns only if it could not start
        loop.call_soon_threadsafe(failed.set)

    # The server never returns: a daemon thread, which ends with the process.
    threading.Thread(target=run, name="ggml-rpc", daemon=True).start()
    await asyncio.to_thread(ggml_rpc.wait_listening, endpoint, 30.0)
    s = spec.shard
    log.info(
        "stage %d: layers %d-%d served at %s", s.rank, s.start_layer, s.end_layer - 1, endpoint
    )
    await state.report("Ready", progress=1.0, endpoint=endpoint)
    done = asyncio.ensure_future(failed.wait())
    halt = asyncio.ensure_future(stop.wait())
    await asyncio.wait([done, halt], return_when=asyncio.FIRST_COMPLETED)
    halt.cancel()
    done.cancel()
    if failed.is_set():
        raise RuntimeError(f"the RPC server at {endpoint} stopped")


async def connect_stages(spec: RunnerSpec, peers: Peers, state: StateReporter) -> dict[str, Any]:
    """At the head: wait for the later stages to listen, register them; the ``Llama``
    arguments that load the model across them."""
    offload = rpc_offload(spec.shard, spec.peers)
    ggml_rpc.check_available()
    await state.report("Loading", progress=0.0)
    endpoints = await peers.wait_ready(spec.peer_timeout_s)
    # ggml aborts the whole process on a server it cannot reach: check first (a stage whose
    # node died without a word still looks Ready in the log).
    for peer, endpoint in zip(spec.peers, endpoints, strict=True):
        try:
            await asyncio.to_thread(ggml_rpc.wait_listening, endpoint, 5.0)
        except TimeoutError:
            raise Unreachable(unreachable(spec, peer, endpoint)) from None
    ggml_rpc.add_servers(endpoints)
    log.info("stages at %s; offload %s", ", ".join(endpoints), offload)
    return offload
