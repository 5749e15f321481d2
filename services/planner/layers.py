"""Dividing a model's layers between pipeline stages in proportion to weights."""

from __future__ import annotations

import math
from collections.abc import Sequence


def split_layers(n_layers: int, weights: Sequence[float]) -> list[int]:
    """Layers per stage, proportional to ``weights`` by the largest-remainder method, at least
    one layer each, summing to ``n_layers``. Ties go to the earlier stage, so the result is
    deterministic. Needs ``1 <= len(weights) <= n_layers`` and positive weights."""
    k = len(weights)
    if not 1 <= k <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {k} stages")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    # Scaled to the largest first, so that huge weights (1e308) cannot overflow the sum.
    top = max(weights)
    scaled = [w / top for w in weights]
    if any(not math.isfinite(w) for w in scaled):
        raise ValueError(f"weights must be finite, got {list(weights)}")
    total = math.fsum(scaled)
    quotas = [n_layers * w / total for w in scaled]
    counts = [max(1, math.floor(q)) for q in quotas]
    surplus = sum(counts) - n_layers
    if surplus < 0:
        # Hand out what flooring left over, to whoever is furthest below quota (a stage raised
        # to the one-layer minimum is not below it).
        order = sorted(range(k), key=lambda i: (-(quotas[i] - counts[i]), i))
        for i in order[:-surplus]:
            counts[i] += 1
    while surplus > 0:
        # The minimum of one layer overshot: take back from whoever is furthest above quota.
        i = max((i for i in range(k) if counts[i] > 1), key=lambda i: (counts[i] - quotas[i], i))
        counts[i] -= 1
        surplus -= 1
    return counts
