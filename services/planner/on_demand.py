"""Instances made on demand (a request for a model nothing served): when one is unloaded, idle
past its keep-alive, and which are unloaded to make room for another. Pure functions of the
projection, the time and what is busy, so that any planner decides the same.

An instance made on demand (``InstanceRequested.on_demand``) is unloaded once no task of its
model and role is unfinished and its last task ended ``keep_alive_s`` ago (the default when it
has none; a negative one keeps it). Instances made explicitly are pinned: never unloaded unless
asked. To make room for an instance that does not fit (memory, or a node's limit on loaded
instances), idle on-demand instances are unloaded, least recently used first, as few as it
takes; a busy one never is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta

from events.kinds import InstanceRole, role_of_task
from projectors.rows import InstanceRow
from projectors.state import ClusterState
from services.planner.cluster import HOLDING, ClusterView

DEFAULT_KEEP_ALIVE_S = 300.0
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")

# Unfinished tasks by (model, role): an instance of a busy pair is never unloaded.
Busy = Mapping[tuple[str, InstanceRole], int]


def parse_keep_alive(value: float | str) -> float:
    """A keep-alive as Ollama takes it: seconds (a number, or text such as '300'), or a duration
    ('5m', '1h', '90s', '1.5h'); negative: for ever. ``ValueError`` for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        found = _DURATION.match(value.strip())
        if found is None:
            raise ValueError(f"{value!r} is not a duration (seconds, or such as 5m, 1h, 90s)")
        seconds = float(found.group(1)) * _UNITS[found.group(2) or "s"]
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{value!r} is not a duration")
    return seconds


def busy_roles(unfinished: Mapping[tuple[str, str], int]) -> dict[tuple[str, InstanceRole], int]:
    """Unfinished tasks by model and kind, as ``Busy``: embeddings keep embed instances busy,
    reranking rerank ones, the rest chat ones."""
    found: dict[tuple[str, InstanceRole], int] = {}
    for (model_id, kind), n in unfinished.items():
        role = role_of_task(kind)
        found[(model_id, role)] = found.get((model_id, role), 0) + n
    return found


def last_used(inst: InstanceRow) -> datetime | None:
    """When the instance last served (its last task's end), else since when it is loaded."""
    return inst.last_used_at or inst.placed_at or inst.requested_at


def keep_alive_s(inst: InstanceRow, default_s: float) -> float | None:
    """How long ``inst`` stays loaded once idle; None: for ever (pinned, or kept)."""
    if not inst.on_demand:
        return None
    keep = inst.keep_alive_s if inst.keep_alive_s is not None else default_s
    return None if keep < 0 else keep


def expires_at(inst: InstanceRow, default_s: float) -> datetime | None:
    """When an idle ``inst`` is unloaded; None: never (Ollama's ``/api/ps`` shows it)."""
    keep, since = keep_alive_s(inst, default_s), last_used(inst)
    if keep is None or since is None:
        return None
    return since + timedelta(seconds=keep)


def busy(inst: InstanceRow, tasks: Busy) -> bool:
    return tasks.get((inst.model_id, inst.role), 0) > 0


def idle(state: ClusterState, now: datetime, tasks: Busy, default_s: float) -> list[InstanceRow]:
    """The on-demand instances to unload now: placed, not busy, past their keep-alive."""
    due = []
    for inst in state.instances():
        expiry = expires_at(inst, default_s)
        if (
            inst.status == "placed"
            and expiry is not None
            and expiry <= now
            and not busy(inst, tasks)
        ):
            due.append(inst)
    return sorted(due, key=lambda i: i.instance_id)


def next_expiry(state: ClusterState, default_s: float) -> datetime | None:
    """The earliest moment an on-demand instance may become idle past its keep-alive: when a
    planner must look again although nothing happened."""
    times = [
        expiry
        for inst in state.instances()
        if inst.status == "placed" and (expiry := expires_at(inst, default_s)) is not None
    ]
    return min(times, default=None)


def evictable(state: ClusterState, tasks: Busy, sparing: str) -> list[InstanceRow]:
    """The instances that may be unloaded to make room for ``sparing``: on demand, placed,
    not busy; least recently used first."""
    found = [
        i
        for i in state.instances()
        if i.on_demand and i.status == "placed" and i.instance_id != sparing and not busy(i, tasks)
    ]
    never = datetime.min.replace(tzinfo=UTC)
    return sorted(found, key=lambda i: (last_used(i) or never, i.instance_id))


def loaded_per_node(state: ClusterState, excluding: Iterable[str] = ()) -> dict[str, set[str]]:
    """The instances each node holds shards of (placed, or being deleted)."""
    skip = set(excluding)
    loaded: dict[str, set[str]] = {}
    for runner in state.runners():
        inst = state.instance(runner.instance_id)
        if inst is None or inst.status not in HOLDING or inst.instance_id in skip:
            continue
        loaded.setdefault(runner.node_id, set()).add(inst.instance_id)
    return loaded


def within_limit(
    view: ClusterView, loaded: Mapping[str, set[str]], limit: int | None
) -> ClusterView:
    """``view`` without the nodes that hold ``limit`` instances already (None: no limit)."""
    if limit is None:
        return view
    full = {node for node, held in loaded.items() if len(held) >= limit}
    if not full:
        return view
    devices = {ref: d for ref, d in view.devices.items() if d.node_id not in full}
    return ClusterView(devices, view.node_status)
