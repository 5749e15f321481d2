"""Cluster endpoints: state, instances, placement preview, the live event feed, health."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from sqlalchemy import text

from api import projection
from api.admission import AdmissionState
from api.cluster.event_feed import FeedBuffer, overflow_event
from api.cluster.requests import InstanceRequest
from api.context import ApiContext, context, require_key
from api.errors import ApiError
from api.model_adding import add_model
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM, stream_of
from events.catalogue import InstanceDeleteRequested, InstanceRequested, chunk_stream_type
from events.subjects import ALL_EVENTS, CHUNKS_PREFIX, EVENTS_PREFIX
from projectors.state import ClusterState
from services.models.catalogue import builtin_cards
from services.planner.cluster import cluster_view
from services.planner.instance_request import RequestRefused, placement_request
from services.planner.placement import (
    Placement,
    PlacementRequest,
    Rejection,
    place,
)

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
health = APIRouter()
Ctx = Annotated[ApiContext, Depends(context)]


@health.get("/healthz")
@health.get("/health")  # what load balancers and llama.cpp's and vLLM's clients probe
async def healthz(ctx: Ctx) -> dict[str, Any]:
    """Liveness and what this API process can reach (no key needed)."""
    db_ok = True
    try:
        async with ctx.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except Exception:
        db_ok = False
    return {
        "status": "ok" if db_ok and ctx.nc.is_connected else "degraded",
        "nats": ctx.nc.is_connected,
        "database": db_ok,
    }


@router.get("/state")
async def state(ctx: Ctx, tasks: Annotated[int, Query(ge=0, le=1000)] = 50) -> dict[str, Any]:
    """Nodes with their latest profile and devices, instances with their shards, runners,
    and the most recent tasks."""
    s = await projection.cluster(ctx.engine)
    return {
        "nodes": [
            projection.row_dict(n)
            | {"devices": [projection.row_dict(d) for d in s.devices_of(n.node_id)]}
            for n in sorted(s.nodes(), key=lambda n: n.node_id)
        ],
        "models": [projection.row_dict(m) for m in sorted(s.models(), key=lambda m: m.model_id)],
        "instances": [_instance(s, i.instance_id) for i in _instances(s, include_deleted=False)],
        "runners": [projection.row_dict(r) for r in sorted(s.runners(), key=lambda r: r.runner_id)],
        "tasks": await projection.recent_tasks(ctx.engine, tasks),
    }


@router.get("/admission")
async def admission(ctx: Ctx) -> AdmissionState:
    """This API process's admission control, per model it has served: its capacity (the
    serving runners' slots), tasks in flight, requests queued and refused, and waiting times.
    Each API process answers for itself."""
    return AdmissionState(origin=ctx.origin, models=ctx.admission.snapshot())


@router.get("/instances")
async def list_instances(
    ctx: Ctx, include_deleted: Annotated[bool, Query()] = False
) -> dict[str, Any]:
    s = await projection.cluster(ctx.engine)
    data = [_instance(s, i.instance_id) for i in _instances(s, include_deleted)]
    return {"object": "list", "data": data}


@router.get("/instances/{instance_id}")
async def get_instance(instance_id: str, ctx: Ctx) -> dict[str, Any]:
    s = await projection.cluster(ctx.engine)
    if s.instance(instance_id) is None:
        raise ApiError(404, f"no instance {instance_id!r}", param="instance_id")
    return _instance(s, instance_id)


@router.post("/instances", status_code=202)
async def create_instance(body: InstanceRequest, ctx: Ctx) -> dict[str, Any]:
    """Ask for a model to be served. Checked against the live cluster first: a request that
    cannot be placed now is refused with the reason, unless ``queue`` is true."""
    s = await projection.cluster(ctx.engine)
    spec = _spec_text(body.placement)
    request = _checked(s, body, spec)
    result = place(cluster_view(s), request)
    if isinstance(result, Rejection) and not body.queue:
        raise ApiError(
            400, f"{body.model} cannot be placed: {result.reason}", code="placement_rejected"
        )
    card = builtin_cards().get(body.model) if s.model(body.model) is None else None
    if card is not None:
        # A catalogue model the cluster does not know yet: added now (weights into the
        # models bucket), then placed from its own facts rather than the card's estimate.
        s = await add_model(ctx, card)
        result = _preview(s, body, spec)
    instance_id = f"{body.model}-{_short_id()}"
    await ctx.publish(
        InstanceRequested(
            instance_id=instance_id,
            model_id=body.model,
            origin=ctx.origin,
            placement=spec,
            replicas=body.replicas,
            context_length=body.context_length,
            aliases=body.aliases,
            role=request.role,
            slots=body.slots,
            kv_cache=body.kv_cache,
            speculative=body.speculative,
        )
    )
    return {
        "id": instance_id,
        "object": "instance",
        "model": body.model,
        "status": "requested",
        "role": request.role,
        "preview": _plan(result),
        "added": card is not None,
    }


@router.delete("/instances/{instance_id}", status_code=202)
async def delete_instance(instance_id: str, ctx: Ctx) -> dict[str, Any]:
    s = await projection.cluster(ctx.engine)
    inst = s.instance(instance_id)
    if inst is None or inst.status == "deleted":
        raise ApiError(404, f"no instance {instance_id!r}", param="instance_id")
    await ctx.publish(
        InstanceDeleteRequested(
            instance_id=instance_id, origin=ctx.origin, reason="DELETE /v1/instances"
        )
    )
    return {"id": instance_id, "object": "instance", "status": "deleting"}


@router.post("/placement/preview")
async def preview(body: InstanceRequest, ctx: Ctx) -> dict[str, Any]:
    """Where the model would be placed now, or why it cannot be (the planner's own function)."""
    s = await projection.cluster(ctx.engine)
    result = _preview(s, body, _spec_text(body.placement))
    return {"model": body.model, **_plan(result)}


@router.get("/events", response_model=None)
async def events(
    request: Request,
    ctx: Ctx,
    subject: Annotated[str, Query(description="NATS subject filter")] = ALL_EVENTS,
    last: Annotated[
        int, Query(ge=0, le=10_000, description="Start with this many past events")
    ] = 0,
) -> StreamingResponse:
    """The event log, live, as server-sent events (``event: <type>``, ``data: <event JSON>``).
    A client that cannot keep up gets an ``error`` event (``events_overflow``) and is let go."""
    problem = _subject_problem(subject)
    if problem is not None:
        raise ApiError(400, f"subject {subject!r}: {problem}", param="subject")
    return StreamingResponse(
        _tail(request, ctx, subject, last),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def _subject_problem(subject: str) -> str | None:
    """Why ``subject`` is not a filter on Shoal's streams, or None. Checked here, before the
    response starts: NATS's own refusal would come after a 200."""
    if stream_of(subject) not in (EVENTS_STREAM, CHUNKS_STREAM):
        return f"it must start with {EVENTS_PREFIX}. or {CHUNKS_PREFIX}."
    tokens = subject.split(".")
    for i, token in enumerate(tokens):
        if not token:
            return "empty token (two dots, or a dot at the end)"
        if any(c.isspace() or not c.isprintable() for c in token):
            return "whitespace or control characters"
        if ">" in token and (token != ">" or i != len(tokens) - 1):
            return "'>' must be the whole last token"
        if "*" in token and token != "*":
            return "'*' must be a whole token"
    return None


async def _tail(request: Request, ctx: ApiContext, subject: str, last: int) -> AsyncIterator[str]:
    # Bounded in bytes: a client that cannot keep up is told so and let go (event_feed.py).
    buffer: FeedBuffer[Msg] = FeedBuffer(ctx.config.events_buffer_bytes)
    ready = asyncio.Event()
    sub: JetStreamContext.PushSubscription | None = None
    dropping: asyncio.Task[None] | None = None

    def drop() -> None:
        """Stop receiving for an overflowed client now, not when its last event is sent (a
        client that reads nothing would hold the subscription until it leaves). From a task
        of its own: unsubscribing cancels the task that runs ``on_msg``."""
        nonlocal dropping
        if sub is not None and dropping is None:
            dropping = asyncio.create_task(sub.unsubscribe())

    async def on_msg(msg: Msg) -> None:
        if not buffer.offer(msg, len(msg.data)):
            drop()
        ready.set()

    js = ctx.nc.jetstream()
    if last:
        info = await js.stream_info(stream_of(subject) or EVENTS_STREAM)
        start = max(1, info.state.last_seq - last + 1)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
    else:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    sub = await js.subscribe(subject, cb=on_msg, ordered_consumer=True, config=config)
    if buffer.overflowed:  # already, with the past events (before ``sub`` was set)
        drop()
    try:
        yield ": tailing the event log\n\n"
        while not await request.is_disconnected():
            msg = buffer.take()
            if msg is None:
                if buffer.overflowed:
                    yield overflow_event(buffer.limit)
                    return
                ready.clear()
                try:
                    await asyncio.wait_for(ready.wait(), timeout=15)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                continue
            kind = (
                msg.subject.rsplit(".", 1)[-1]
                if msg.subject.startswith(EVENTS_PREFIX)
                else chunk_stream_type(msg.data)
            )
            data = msg.data.decode(errors="replace").replace("\n", " ")
            yield f"id: {msg.metadata.sequence.stream}\nevent: {kind}\ndata: {data}\n\n"
    finally:
        if dropping is not None:
            await dropping
        else:
            await sub.unsubscribe()


def _instances(s: ClusterState, include_deleted: bool) -> list[Any]:
    rows = [i for i in s.instances() if include_deleted or i.status != "deleted"]
    return sorted(rows, key=lambda i: (str(i.requested_at), i.instance_id))


def _instance(s: ClusterState, instance_id: str) -> dict[str, Any]:
    inst = s.instance(instance_id)
    assert inst is not None
    runners = sorted(s.runners_of(instance_id), key=lambda r: (r.replica, r.rank))
    return {
        "id": instance_id,
        "object": "instance",
        **projection.row_dict(inst),
        "shards": [projection.row_dict(r) for r in runners],
    }


def _spec_text(placement: str | dict[str, object] | None) -> str | None:
    """The placement as JSON text, as the log keeps it (checked by ``_checked``)."""
    if placement is None or isinstance(placement, str):
        return placement
    return json.dumps(placement)


def _checked(s: ClusterState, body: InstanceRequest, spec: str | None) -> PlacementRequest:
    """The request as placement takes it, or the 400 (404: an unknown model) saying why."""
    try:
        return placement_request(
            s,
            instance_id="preview",
            model_id=body.model,
            spec=spec,
            role=body.role,
            replicas=body.replicas,
            context_length=body.context_length,
            slots=body.slots,
            kv_cache=body.kv_cache,
            speculative=body.speculative,
        )
    except RequestRefused as exc:
        if exc.unknown_model:
            message = exc.message[:1].upper() + exc.message[1:]
            raise ApiError(404, message, param="model", code="model_not_found") from None
        raise ApiError(400, exc.message, param=exc.field) from None


def _preview(s: ClusterState, body: InstanceRequest, spec: str | None) -> Placement | Rejection:
    return place(cluster_view(s), _checked(s, body, spec))


def _plan(result: Placement | Rejection) -> dict[str, Any]:
    if isinstance(result, Rejection):
        return {
            "placeable": False,
            "reason": result.reason,
            "needed_bytes": result.needed_bytes,
            "available_bytes": result.available_bytes,
        }
    return {
        "placeable": True,
        "context_length": result.context_length,
        "slots": result.slots,
        "kv_cache": result.kv_cache,
        "need_bytes_per_replica": result.need_bytes,
        "shards": [
            s.model_dump(exclude={"runner_id"}) | {"bytes": result.shard_bytes[s.runner_id]}
            for s in result.shards
        ],
        "why": list(result.why),  # by replica: why it went where it did
    }


def _short_id() -> str:
    return secrets.token_hex(3)
