"""Tasks: created, started and ended, with what ending means for on-demand instances
(keep-alive, last use) and for a key's usage."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from events.catalogue import (
    EmbeddingsRequested,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
    TaskStarted,
)
from events.kinds import InstanceRole, role_of_task
from events.states import INSTANCE_LIVE, TASK_ENDED, TaskStatus
from projectors.rows import (
    InstanceRow,
    TaskRow,
    UsageRow,
)
from projectors.state import Change, ClusterState, Delete, Put


def task_created(state: ClusterState, e: TaskCreated) -> list[Change]:
    old = state.task(e.task_id)
    if old is not None:
        if e.resume is None or old.status in TASK_ENDED or old.resumes >= e.resume.attempt:
            return []
        # A continuation: waiting for a runner again, as often resumed as it says.
        return [Put(replace(old, status="pending", resumes=e.resume.attempt))]
    row = TaskRow(
        task_id=e.task_id,
        model_id=e.model_id,
        status="pending",
        kind=e.kind,
        user=e.user,
        max_tokens=e.params.max_tokens,
        created_at=e.ts,
        owner=e.owner,
    )
    return [Put(row), *_kept_alive(state, e.model_id, "chat", e.keep_alive_s)]


def embeddings_requested(state: ClusterState, e: EmbeddingsRequested) -> list[Change]:
    if state.task(e.task_id) is not None:
        return []
    row = TaskRow(
        task_id=e.task_id,
        model_id=e.model_id,
        status="pending",
        kind=e.kind,
        user=e.user,
        created_at=e.ts,
        owner=e.owner,
    )
    return [Put(row), *_kept_alive(state, e.model_id, e.role, e.keep_alive_s)]


def _on_demand_serving(state: ClusterState, model_id: str, role: InstanceRole) -> list[InstanceRow]:
    return [
        i
        for i in state.instances()
        if i.on_demand and i.model_id == model_id and i.role == role and i.status in INSTANCE_LIVE
    ]


def _kept_alive(
    state: ClusterState, model_id: str, role: InstanceRole, keep_alive_s: float | None
) -> list[Change]:
    """A task that says how long its model stays loaded once idle (Ollama's keep_alive) sets it
    for the on-demand instances serving it; pinned ones stay pinned."""
    if keep_alive_s is None:
        return []
    return [
        Put(replace(i, keep_alive_s=keep_alive_s))
        for i in _on_demand_serving(state, model_id, role)
        if i.keep_alive_s != keep_alive_s
    ]


def _used(state: ClusterState, task: TaskRow, at: datetime) -> list[Change]:
    """A task ended: the on-demand instances of its model and role were used until ``at`` (their
    keep-alive counts from there)."""
    role = role_of_task(task.kind)
    return [
        Put(replace(i, last_used_at=at)) for i in _on_demand_serving(state, task.model_id, role)
    ]


def task_started(state: ClusterState, e: TaskStarted) -> list[Change]:
    old = state.task(e.task_id)
    if old is None:
        return []
    status = old.status if old.status in TASK_ENDED else "running"
    row = replace(
        old, status=status, started_at=e.ts, runner_id=e.runner_id, instance_id=e.instance_id
    )
    return [Put(row)]


def _superseded(old: TaskRow, e: TaskCompleted | TaskFailed) -> bool:
    """An outcome of an attempt continued since (its runner was stalled, not lost): the task
    goes on with the newer attempt (``resumes`` counts them; events/attempts.py)."""
    return e.attempt is not None and e.attempt < old.resumes


def task_completed(state: ClusterState, e: TaskCompleted) -> list[Change]:
    old = state.task(e.task_id)
    if old is None or _superseded(old, e):
        return []
    # A runner that honoured a cancel reports finish_reason "cancelled": keep "cancelled".
    status: TaskStatus = "cancelled" if old.status == "cancelled" else "completed"
    row = replace(
        old,
        status=status,
        finished_at=e.ts,
        runner_id=e.runner_id,
        prompt_tokens=e.usage.prompt_tokens,
        completion_tokens=e.usage.completion_tokens,
        ttft_ms=e.timings.ttft_ms,
        tokens_per_s=e.timings.tokens_per_s,
        total_ms=e.timings.total_ms,
        finish_reason=e.finish_reason,
    )
    changes: list[Change] = [Put(row), *_used(state, old, e.ts)]
    if old.owner is not None and old.status != "completed":  # counted once
        used = state.usage(old.owner, old.model_id) or UsageRow(old.owner, old.model_id)
        used = replace(
            used,
            requests=used.requests + 1,
            prompt_tokens=used.prompt_tokens + e.usage.prompt_tokens,
            cached_tokens=used.cached_tokens + e.usage.cached_tokens,
            completion_tokens=used.completion_tokens + e.usage.completion_tokens,
        )
        changes.append(Put(used))
    return changes


def task_failed(state: ClusterState, e: TaskFailed) -> list[Change]:
    old = state.task(e.task_id)
    if old is None or old.status in TASK_ENDED or _superseded(old, e):
        return []
    row = replace(
        old,
        status="failed",
        finished_at=e.ts,
        error=e.error,
        runner_id=e.runner_id or old.runner_id,
    )
    return [Put(row), *_used(state, old, e.ts)]


def task_cancelled(state: ClusterState, e: TaskCancelled) -> list[Change]:
    old = state.task(e.task_id)
    if old is None or old.status in TASK_ENDED:
        return []
    row = replace(old, status="cancelled", finished_at=e.ts, error=e.reason or None)
    return [Put(row), *_used(state, old, e.ts)]


def task_forgotten(state: ClusterState, e: TaskForgotten) -> list[Change]:
    # Only an ended task leaves; its key's usage stays counted (key_usage).
    old = state.task(e.task_id)
    if old is None or old.status not in TASK_ENDED:
        return []
    return [Delete(TaskRow.TABLE, old.key())]
