"""Pipeline stages for runner tests: one replica of a model cut at given layer bounds."""

from __future__ import annotations

from events.records import ShardAssignment


def stages(*bounds: int) -> list[ShardAssignment]:
    """Stages ``s0, s1...`` on nodes ``n0, n1...`` cutting the model's layers at ``bounds``
    (the first 0, the last the model's layer count), as a placement would."""
    n = len(bounds) - 1
    return [
        ShardAssignment(
            runner_id=f"s{r}",
            node_id=f"n{r}",
            rank=r,
            world_size=n,
            start_layer=bounds[r],
            end_layer=bounds[r + 1],
            n_layers=bounds[-1],
            tensor_split=[float(bounds[i + 1] - bounds[i]) for i in range(n)],
        )
        for r in range(n)
    ]
