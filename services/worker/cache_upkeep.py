"""A worker's upkeep of its node's weights cache (``services/models/weights_cache.py``), the file
operations around two pure choices:

- **Room within the budget.** Before the worker starts runners, what they are about to fetch
  is added to what the cache holds; over the budget (``--cache-size``), the models no runner
  of the node uses are evicted, least recently used first (``cache_budget.choose_evictions``),
  each said on the log with ``ModelEvicted``.
- **A removed model's files.** Once ``ModelRemoved`` is folded, the model's directory goes, and
  its blobs that no model the cluster knows names (a copy is deleted; a link to a file that
  was on this machine is unlinked, the file left alone).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime

from events.catalogue import EventBase, ModelEvicted, WeightFile
from modelfiles.shard_files import SAFETENSORS_INDEX, needed_files
from services.models.cache_budget import CacheSize, Eviction, choose_evictions
from services.models.weights_cache import WeightsCache
from services.runner import RunnerSpec
from services.worker.profile import disk_total

log = logging.getLogger(__name__)

Publish = Callable[[EventBase], Awaitable[object]]


def shard_needs(spec: RunnerSpec, weight_map: Mapping[str, str] | None) -> list[WeightFile]:
    """The files a runner's shard fetches (``weight_map``: an MLX model's safetensors index,
    when the cache holds it; without it every file is counted, an estimate on the safe side)."""
    shard = spec.shard
    return needed_files(
        spec.files,
        spec.engine,
        shard.rank,
        shard.start_layer,
        shard.end_layer,
        shard.n_layers,
        weight_map,
    )


class CacheUpkeep:
    def __init__(
        self, cache: WeightsCache, size: CacheSize, node_id: str, publish: Publish
    ) -> None:
        self.cache = cache
        self.size = size
        self.node_id = node_id
        self._publish = publish

    def budget(self) -> int | None:
        return self.size.budget(disk_total(self.cache.root))

    async def make_room(self, specs: Iterable[RunnerSpec]) -> Eviction:
        """Evict what the runners of ``specs`` (all of this node's, kept and starting) need
        room for; their models and files stay."""
        specs = list(specs)
        budget = await asyncio.to_thread(self.budget)
        if budget is None:
            return Eviction()
        in_use = {s.model_id for s in specs}

        def choose() -> tuple[Eviction, int]:
            needed = {f.sha256: f for s in specs for f in shard_needs(s, self._weight_map(s))}
            missing = sum(f.size for f in needed.values() if not self.cache.holds(f))
            models = [replace(m, in_use=m.name in in_use) for m in self.cache.models()]
            costs = self.cache.blob_costs()
            return choose_evictions(models, costs, budget, missing, frozenset(needed)), missing

        eviction, missing = await asyncio.to_thread(choose)
        if not eviction.blobs and not eviction.models:
            if eviction.over_by:
                log.warning(self._over(eviction, budget))
            return eviction
        await asyncio.to_thread(self._evict, eviction)
        reason = f"room for {missing} bytes for this node's runners"
        for model_id, freed in eviction.models:
            log.info("evicted %s from the weights cache (%d bytes freed)", model_id, freed)
            await self._publish(
                ModelEvicted(
                    node_id=self.node_id,
                    model_id=model_id,
                    origin=self.node_id,
                    bytes_freed=freed,
                    budget_bytes=budget,
                    reason=reason,
                )
            )
        if eviction.orphan_bytes:
            log.info("deleted %d bytes of blobs no model links to", eviction.orphan_bytes)
        if eviction.over_by:
            log.warning(self._over(eviction, budget))
        return eviction

    def _over(self, eviction: Eviction, budget: int) -> str:
        return (
            f"the weights cache will hold {eviction.over_by} bytes beyond its budget of"
            f" {budget} ({self.size}): the models its runners use need more"
        )

    def _weight_map(self, spec: RunnerSpec) -> Mapping[str, str] | None:
        index = next((f for f in spec.files if f.name == SAFETENSORS_INDEX), None)
        if spec.engine != "mlx" or index is None or not self.cache.holds(index):
            return None
        try:
            found = json.loads(self.cache.blob(index.sha256).read_text()).get("weight_map")
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    def _evict(self, eviction: Eviction) -> None:
        for model_id, _ in eviction.models:
            self.cache.drop_model(model_id)
        for sha in eviction.blobs:
            self.cache.drop_blob(sha)

    async def forget(
        self,
        model_id: str,
        files: Iterable[WeightFile],
        removed_at: datetime,
        named: Iterable[str],
    ) -> None:
        """Let go of a removed model's directory and of its blobs not in ``named`` (the SHA-256s
        of the files of every model the cluster knows). A blob made since the removal is kept:
        an add of the same file may have linked it a moment ago, before its event."""
        kept = set(named)
        before = removed_at.timestamp()

        def drop() -> int:
            self.cache.drop_model(model_id)
            return sum(
                self.cache.drop_blob(f.sha256, made_before=before)
                for f in files
                if f.sha256 not in kept
            )

        freed = await asyncio.to_thread(drop)
        log.info("model %s was removed: %d bytes of its files deleted here", model_id, freed)
