"""Models: added to the cluster, removed from it."""

from __future__ import annotations

from events.catalogue import (
    ModelAdded,
    ModelRemoved,
)
from projectors.rows import (
    ModelRow,
)
from projectors.state import Change, ClusterState, Delete, Put


def model_added(state: ClusterState, e: ModelAdded) -> list[Change]:
    row = ModelRow(
        model_id=e.model_id,
        n_layers=e.n_layers,
        size_bytes=e.size_bytes,
        family=e.family,
        context_length=e.context_length,
        engines=list(e.engines),
        chat_format=e.chat_format,
        source=e.source,
        path=e.path,
        added_at=e.ts,
        kv_bytes_per_token=e.kv_bytes_per_token,
        overhead_bytes=e.overhead_bytes,
        # None rather than [] when there are none: the row of an event from before the bucket.
        files=[f.model_dump() for f in e.files] or None,
        node_id=e.node_id,
        vision=e.vision,
    )
    return [Put(row)]


def model_removed(state: ClusterState, e: ModelRemoved) -> list[Change]:
    # Refused at the edge while a live instance uses it; an instance row that names it later
    # is placed as any instance of an unknown model is (rejected).
    old = state.model(e.model_id)
    return [Delete(ModelRow.TABLE, old.key())] if old is not None else []
