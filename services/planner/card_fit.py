"""Whether a model fits the cluster now, from its card or from what the cluster knows of it:
``place`` on the live cluster view, as a request for one instance of it would be. Pure."""

from __future__ import annotations

from projectors.state import ClusterState
from services.models.cards import ModelCard
from services.models.footprint import Footprint
from services.planner.cluster import cluster_view
from services.planner.placement import ModelInfo, PlacementRequest, Rejection, place


def card_info(card: ModelCard) -> ModelInfo | None:
    """What placement needs, from the card's estimate (None: the card has none)."""
    e = card.estimate
    if e is None:
        return None
    footprint = Footprint(
        n_layers=e.n_layers,
        weights_bytes=e.size_bytes + e.projector_bytes,
        kv_bytes_per_token=e.kv_bytes_per_token,
        overhead_bytes=e.overhead_bytes,
    )
    return ModelInfo(card.id, footprint, e.context_length, card.engines[0])


def fits_now(state: ClusterState, card: ModelCard) -> tuple[bool, str]:
    """Whether one instance of the model would be placed now, and how: on which node, split
    over how many, or why not. The cluster's own facts of the model win over the card's."""
    known = state.model(card.id)
    info = ModelInfo.of(known) if known is not None else card_info(card)
    if info is None:
        return False, "no size known"
    result = place(cluster_view(state), PlacementRequest(instance_id="fit", model=info))
    if isinstance(result, Rejection):
        return False, result.reason
    nodes = sorted({s.node_id for s in result.shards})
    return True, nodes[0] if len(nodes) == 1 else f"split over {len(nodes)} nodes"
