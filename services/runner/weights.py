"""A runner's weights: from the node's cache, filled from another node or the models bucket, or
at a path.

- A shared model (``files``): the files this shard needs, fetched into the node's cache unless
  it holds them (``services/models/shared.py``: from a node that holds them, else the bucket);
  a package's file on this machine with the same bytes is linked rather than fetched (every
  node has Shoal's built-in models' packages installed).
- A model at a path (``--local``, or added before the bucket): that path.
- Neither: a built-in card, resolved here (a package's file, or a download).

A model's projector file (it reads images) is one of its files, fetched into the cache with
the weights for a pipeline's head (a local model's too), or its card's, resolved here.

Progress is reported as ``Downloading``, at most once a second.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.client import Client

from services.models.cards import PackageSource
from services.models.catalogue import builtin_cards, card_for
from services.models.projector import projector_of, weights_of
from services.models.resolve import (
    ProgressThrottle,
    local_path,
    resolve_model,
    resolve_projector,
)
from services.models.shared import fetch_files, shard_model_path
from services.models.weights_cache import WeightsCache, sha256_of
from services.runner.spec import RunnerSpec
from services.runner.state_reporter import StateReporter


async def shard_weights(spec: RunnerSpec, nc: Client, state: StateReporter) -> Path:
    """The path this shard's engine loads."""
    loop = asyncio.get_running_loop()

    def on_fraction(fraction: float) -> None:  # from a thread or the loop, thinned already
        asyncio.run_coroutine_threadsafe(
            state.report("Downloading", progress=round(fraction, 4)), loop
        )

    throttle = ProgressThrottle(on_fraction)
    if spec.model_path is not None and not weights_of(spec.files):
        return Path(spec.model_path)
    if not spec.files:
        card = card_for(spec.model_id)
        return await asyncio.to_thread(resolve_model, card, Path(spec.cache_dir), on_fraction)
    cache = WeightsCache(Path(spec.cache_dir))
    await adopt_package_file(spec, cache)
    shard = spec.shard

    def on_bytes(done: int, total: int) -> None:
        if total:
            throttle.update(done / total)

    return await shard_model_path(
        nc,
        cache,
        spec.model_id,
        spec.files,
        engine=spec.engine,
        rank=shard.rank,
        start=shard.start_layer,
        end=shard.end_layer,
        n_layers=shard.n_layers,
        on_progress=on_bytes,
        node_id=spec.node_id,
    )


async def shard_projector(spec: RunnerSpec, nc: Client) -> Path | None:
    """The model's projector file, for a whole model or a pipeline's head (None: it has
    none): in the node's cache (fetched with a shared model's weights already), or its
    built-in card's."""
    projector = projector_of(spec.files)
    if projector is None:
        if spec.files or spec.model_path is not None:
            return None
        card = card_for(spec.model_id)
        return await asyncio.to_thread(resolve_projector, card, Path(spec.cache_dir))
    cache = WeightsCache(Path(spec.cache_dir))
    await fetch_files(nc, cache, [projector], node_id=spec.node_id)
    return cache.link(spec.model_id, [projector]) / projector.name


async def adopt_package_file(spec: RunnerSpec, cache: WeightsCache) -> None:
    """A built-in model's weights come in a package every node has installed: when this one's
    file has the bytes the model names, the cache links it instead of fetching a copy."""
    weights = weights_of(spec.files)
    if len(weights) != 1 or cache.holds(weights[0]):
        return
    cards = [c for c in builtin_cards().values() if c.source.label() == spec.source]
    if not cards or not isinstance(cards[0].source, PackageSource):
        return
    path = local_path(cards[0], Path(spec.cache_dir))
    wanted = weights[0]
    if path is None or not path.is_file() or path.stat().st_size != wanted.size:
        return
    if await asyncio.to_thread(sha256_of, path) == wanted.sha256:
        cache.adopt(path, wanted)
