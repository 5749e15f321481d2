"""The worker's decisions, as pure functions: which runners to start or stop, and how long to
wait before restarting one that died."""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from projectors.rows import RunnerRow
from projectors.state import ClusterState


@dataclass(frozen=True)
class Plan:
    start: frozenset[str]
    stop: frozenset[str]


def desired_runners(state: ClusterState, node_id: str) -> dict[str, RunnerRow]:
    """The shards placed on ``node_id`` of instances that are placed (not deleting/deleted)."""
    out: dict[str, RunnerRow] = {}
    for row in state.runners():
        if row.node_id != node_id:
            continue
        inst = state.instance(row.instance_id)
        if inst is not None and inst.status == "placed":
            out[row.runner_id] = row
    return out


def plan(desired: Mapping[str, object], running: Iterable[str]) -> Plan:
    have = frozenset(running)
    want = frozenset(desired)
    return Plan(start=want - have, stop=have - want)


def runner_slots(placed: int | None, override: int | None = None) -> int:
    """Tasks a runner serves at once: the worker's ``--slots`` when given, else what its
    instance was placed with (None: placed before slots were, one)."""
    return override or placed or 1


def restart_delay(consecutive_failures: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Exponential backoff, bounded: 0.5 s, 1 s, 2 s ... at most ``cap``."""
    if consecutive_failures <= 0:
        return 0.0
    return float(min(cap, base * 2 ** (consecutive_failures - 1)))


def describe_exit(code: int) -> str:
    """A readable cause for a runner's exit code (negative: killed by that signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
