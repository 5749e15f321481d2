"""What placing one replica gives: its stages and why (``Placed``), or why not
(``Rejection``); and what a set of stages charges each device."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.models.footprint import Footprint
from services.planner.node_plan import Stages


@dataclass(frozen=True)
class Rejection:
    reason: str
    needed_bytes: int | None = None
    available_bytes: dict[str, int] = field(default_factory=dict)  # usable per 'node:device'


@dataclass(frozen=True)
class Placed:
    stages: Stages
    why: str


def charges_of(placed: Iterable[Stages], fp: Footprint, tokens: int) -> dict[str, int]:
    charges: dict[str, int] = defaultdict(int)
    for stages in placed:
        for stage in stages:
            for ref, need in stage.charges(fp, tokens).items():
                charges[ref] += need
    return dict(charges)
