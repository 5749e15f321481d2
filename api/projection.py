"""What the API reads from the projection: it keeps no state of its own."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, select
from sqlalchemy.ext.asyncio import AsyncEngine

from api.errors import ApiError
from events.kinds import InstanceRole
from events.states import INSTANCE_CURRENT, SERVING, STARTING, RunnerState
from projectors.rows import InstanceRow, ModelRow, Row, RunnerRow
from projectors.state import ClusterState, Put
from projectors.store import load_state
from projectors.tables import instances, models, runners, tasks
from services.planner.planner import PLANNING_TABLES

# A head runner in one of these serves again soon: it is starting, or failed and is restarted
# by its worker.
COMING_BACK: frozenset[RunnerState] = STARTING | {"Failed"}


async def cluster(engine: AsyncEngine) -> ClusterState:
    """Nodes, devices, models, instances and runners (not tasks)."""
    async with engine.connect() as conn:
        return await load_state(conn, PLANNING_TABLES)


# Built once: building it (a label per column) took longer than running it.
_SERVING = (
    select(
        *[c.label(f"i_{c.name}") for c in instances.c],
        *[c.label(f"r_{c.name}") for c in runners.c],
    )
    .select_from(instances.outerjoin(runners, runners.c.instance_id == instances.c.instance_id))
    .where(instances.c.model_id == bindparam("model_id"))
)


async def serving(engine: AsyncEngine, model_id: str, reader: Engine | None = None) -> ClusterState:
    """Only what ``require_serving`` reads: the model's instances with their runners, in one
    query (every chat request asks, and it is in the time to first token); the models only when
    it has no instance. With ``reader`` (SQLite) in one hop to a worker thread."""
    if reader is not None:
        return await asyncio.to_thread(_serving_from, reader, model_id)
    async with engine.connect() as conn:
        return await conn.run_sync(_serving, model_id)


def _serving_from(reader: Engine, model_id: str) -> ClusterState:
    with reader.connect() as conn:
        return _serving(conn, model_id)


def _serving(conn: Connection, model_id: str) -> ClusterState:
    state = ClusterState()
    for row in conn.execute(_SERVING, {"model_id": model_id}).mappings():
        state.commit([Put(InstanceRow(**_prefixed(row, "i_")))])
        if row["r_runner_id"] is not None:
            state.commit([Put(RunnerRow(**_prefixed(row, "r_")))])
    if not any(i.status in INSTANCE_CURRENT for i in state.instances()):
        # Whether the model is known (404 or 503), and for the 404's list of known models.
        for row in conn.execute(select(models)).mappings():
            state.commit([Put(ModelRow(**row))])
    return state


async def model_row(engine: AsyncEngine, model_id: str) -> ModelRow | None:
    """One model's row (None: the cluster does not know it)."""
    async with engine.connect() as conn:
        query = select(models).where(models.c.model_id == model_id)
        row = (await conn.execute(query)).mappings().first()
    return ModelRow(**row) if row is not None else None


def _prefixed(row: Any, prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}


async def recent_tasks(engine: AsyncEngine, limit: int) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        query = select(tasks).order_by(tasks.c.created_at.desc()).limit(limit)
        return [dict(r) for r in (await conn.execute(query)).mappings()]


def require_serving(state: ClusterState, model_id: str, role: InstanceRole = "chat") -> None:
    """Raise the error a request for ``model_id`` gets when it cannot be served now by an
    instance of ``role``: 404 for a model the cluster does not know, 400 for one served only
    in the other role (saying how to ask for this one), 503 (saying why) for one with no
    runner ready."""
    instances = [i for i in state.instances() if i.model_id == model_id]
    alive = [i for i in instances if i.status in INSTANCE_CURRENT]
    # A model removed (or never added) with only deleted instances left is not known.
    if state.model(model_id) is None and not alive:
        known = ", ".join(sorted(r.model_id for r in state.models())) or "none yet"
        raise ApiError(
            404,
            f"The model `{model_id}` does not exist (known models: {known})",
            param="model",
            code="model_not_found",
        )
    live = [i for i in alive if i.role == role]
    if alive and not live:
        raise _wrong_role(model_id, role, {i.role for i in alive})
    for inst in live:
        # A rejected instance's runners are being stopped; only a pipeline's head serves.
        heads = [r for r in state.runners_of(inst.instance_id) if r.rank == 0]
        if inst.status != "rejected" and any(r.state in SERVING for r in heads):
            return
    raise ApiError(
        503,
        f"model `{model_id}` cannot answer now: {_why_not(state, live)}",
        code="model_not_ready",
    )


def coming_back(state: ClusterState, model_id: str, role: InstanceRole = "chat") -> bool:
    """Whether ``model_id`` may serve in ``role`` soon, though it cannot now: a placed instance
    of it has a head runner starting (again). (One waiting for room to be placed may wait for
    ever: not soon.)"""
    for inst in state.instances():
        if inst.model_id != model_id or inst.role != role:
            continue
        heads = [r for r in state.runners_of(inst.instance_id) if r.rank == 0]
        if inst.status == "placed" and any(r.state in COMING_BACK for r in heads):
            return True
    return False


def loaded_models(state: ClusterState) -> set[str]:
    """The models an instance serves now (a placed one whose pipeline head serves): what the
    model lists say is ``loaded``; the others load when asked for (api/on_demand.py)."""
    return {
        inst.model_id
        for inst in state.instances()
        if inst.status == "placed"
        and any(r.rank == 0 and r.state in SERVING for r in state.runners_of(inst.instance_id))
    }


def serving_slots(state: ClusterState, model_id: str, role: InstanceRole = "chat") -> int:
    """How many tasks of ``model_id`` can run at once in ``role``: the slots of its serving
    pipeline heads (rank 0, Ready or Running) in placed instances, a runner without a count
    (older logs) counting 1. The capacity of admission control (api/admission.py)."""
    placed = {
        i.instance_id
        for i in state.instances()
        if i.model_id == model_id and i.role == role and i.status == "placed"
    }
    return sum(
        r.slots or 1
        for r in state.runners()
        if r.instance_id in placed and r.rank == 0 and r.state in SERVING
    )


# What each role's instances are said to serve, in the refusals.
_SERVES: dict[InstanceRole, str] = {"chat": "chat", "embed": "embeddings", "rerank": "reranking"}


def _wrong_role(model_id: str, role: InstanceRole, roles: set[InstanceRole]) -> ApiError:
    """A model whose instances all serve other ``roles``: chat, embed and rerank instances
    are apart (an embedding-mode engine generates nothing, a reranker scores pairs only)."""
    served = " and ".join(_SERVES[r] for r in sorted(roles))
    if role == "rerank":
        body = f'{{"model": "{model_id}", "role": "rerank"}}'
        return ApiError(
            400,
            f"model `{model_id}` is served for {served} only, not for reranking: ask for a"
            " rerank instance of it"
            f" with POST /v1/instances {body} (or `shoal instances create {model_id} --role"
            " rerank`); the model must be a reranker (a GGUF with rank pooling)",
            param="model",
            code="model_not_reranker",
        )
    if role == "embed":
        body = f'{{"model": "{model_id}", "role": "embed"}}'
        return ApiError(
            400,
            f"model `{model_id}` is served for {served} only, not for embeddings:"
            f" ask for an embed instance of it with POST /v1/instances {body}"
            f" (or `shoal instances create {model_id} --role embed`)",
            param="model",
            code="model_not_embedding",
        )
    body = f'{{"model": "{model_id}"}}'
    return ApiError(
        400,
        f"model `{model_id}` is served for {served} only: ask for a chat"
        f" instance of it with POST /v1/instances {body} (or `shoal instances"
        f" create {model_id}`)",
        param="model",
        code="model_not_chat",
    )


def _why_not(state: ClusterState, live: list[InstanceRow]) -> str:
    if not live:
        return "no instance of it is running; create one with POST /v1/instances"
    reasons = []
    for inst in live:
        if inst.status == "requested":
            reasons.append(f"instance {inst.instance_id} is waiting to be placed")
        elif inst.status == "rejected":
            reasons.append(f"instance {inst.instance_id} could not be placed: {inst.reason}")
        else:
            runners = state.runners_of(inst.instance_id)
            states = sorted({r.state for r in runners})
            # A runner that failed says why (a model its role cannot load, for one).
            errors = sorted({r.error for r in runners if r.state == "Failed" and r.error})
            failed = f"; last failure: {errors[0]}" if errors else ""
            reasons.append(
                f"instance {inst.instance_id} is starting (runners: {', '.join(states)}{failed})"
            )
    return "; ".join(reasons)


def row_dict(row: Row) -> dict[str, Any]:
    return asdict(row)
