"""``POST /api/pull``: Ollama's "make this model available", done Shoal's way.

A model the cluster does not know yet, but that is a catalogue card, is made known as
``shoal models add`` does it (its weights fetched on this machine, their facts read, their
files stored in the models bucket, ``ModelAdded`` published). Then, unless one is live
already, an instance is requested (as ``POST /v1/instances`` does, refused if it cannot be
placed): in Shoal a model answers only through an instance, and ``/api/delete`` deletes them.
The progress lines are what the log says: the fetch's and the store's fractions, then the
runners' states (``Downloading`` with its progress, ``Loading``) until one serves:
``{"status": "success"}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from api import projection
from api.context import ApiContext
from api.errors import ApiError
from api.model_adding import add_model
from api.ollama.models import serving_instance
from bus.streams import MODELS_BUCKET
from events.catalogue import InstanceRequested
from events.states import INSTANCE_ENDING, INSTANCE_LIVE, SERVING
from projectors.rows import ModelRow
from projectors.state import ClusterState
from services.models.cards import ModelCard
from services.planner.cluster import cluster_view
from services.planner.placement import ModelInfo, PlacementRequest, Rejection, place

POLL_S = 0.5


@dataclass(frozen=True)
class Step:
    """Where an instance stands, for a pull: a line to send, and whether it is over."""

    line: dict[str, Any]
    ready: bool = False
    error: str | None = None


def pull_step(state: ClusterState, model: ModelRow, instance_id: str, digest: str) -> Step:
    """Pure: the projection in, the pull's progress out."""
    inst = state.instance(instance_id)
    if inst is None:
        return Step({"status": "requesting an instance"})
    if inst.status in INSTANCE_ENDING:
        return Step({}, error=f"instance {instance_id} was deleted")
    if inst.status == "rejected":
        return Step({}, error=f"instance {instance_id} could not be placed: {inst.reason}")
    if inst.status == "requested":
        return Step({"status": "waiting for placement"})
    runners = list(state.runners_of(instance_id))
    if any(r.rank == 0 and r.state in SERVING for r in runners):
        return Step({"status": "success"}, ready=True)
    downloading = [r for r in runners if r.state == "Downloading"]
    if downloading:
        done = sum(r.progress or 0.0 for r in downloading) / len(downloading)
        size = model.size_bytes
        return Step(
            {
                "status": f"pulling {digest[:12]}",
                "digest": f"sha256:{digest}",
                "total": size,
                "completed": min(size, round(done * size)),
            }
        )
    if any(r.state == "Loading" for r in runners):
        return Step({"status": "loading model"})
    failed = [r for r in runners if r.state == "Failed"]
    if failed:
        return Step({"status": f"a runner failed ({failed[0].error}); placing it again"})
    return Step({"status": "starting runners"})


def live_instance(state: ClusterState, model_id: str) -> str | None:
    """A live instance of the model, one that serves first."""
    serving = serving_instance(state, model_id)
    if serving is not None:
        return serving.instance_id
    live = sorted(
        i.instance_id
        for i in state.instances()
        if i.model_id == model_id and i.status in INSTANCE_LIVE
    )
    return live[0] if live else None


def placement_refusal(state: ClusterState, model: ModelRow) -> ApiError | None:
    """The 400 of a model that cannot be placed now (as ``POST /v1/instances``)."""
    request = PlacementRequest(instance_id="preview", model=ModelInfo.of(model))
    result = place(cluster_view(state), request)
    if isinstance(result, Rejection):
        return ApiError(
            400, f"{model.model_id} cannot be placed: {result.reason}", code="placement_rejected"
        )
    return None


async def pull_lines(
    ctx: ApiContext, model_id: str, card: ModelCard | None, digest: str
) -> AsyncIterator[dict[str, Any]]:
    """The pull's progress lines, ending with success; a failure raises ``ApiError``. With
    ``card``, the model is not known yet and is added first."""
    yield {"status": "pulling manifest"}
    if card is not None:
        async for line in _add(ctx, card):
            yield line
    state = await projection.cluster(ctx.engine)
    model = state.model(model_id)
    assert model is not None  # known before the pull, or waited for by _add
    instance_id = live_instance(state, model_id)
    if instance_id is None:
        refused = placement_refusal(state, model)
        if refused is not None:
            raise refused
        instance_id = f"{model_id}-{secrets.token_hex(3)}"
        await ctx.publish(
            InstanceRequested(instance_id=instance_id, model_id=model_id, origin=ctx.origin)
        )
    last: dict[str, Any] | None = None
    # A deadline, not asyncio.timeout: this generator yields to whoever reads it meanwhile.
    deadline = asyncio.get_running_loop().time() + ctx.config.task_timeout_s
    while True:
        step = pull_step(state, model, instance_id, digest)
        if step.error is not None:
            raise ApiError(500, step.error)
        if step.line != last:
            yield step.line
            last = step.line
        if step.ready:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise ApiError(
                504,
                f"instance {instance_id} does not serve yet; it goes on starting"
                f" (GET /v1/instances/{instance_id})",
            )
        await asyncio.sleep(POLL_S)
        state = await projection.cluster(ctx.engine)


async def _add(ctx: ApiContext, card: ModelCard) -> AsyncIterator[dict[str, Any]]:
    """The one way the API adds a model (``api/model_adding.py``), its fractions as lines."""
    loop = asyncio.get_running_loop()
    fractions: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
    source = card.source.label()

    def progress(status: str) -> Callable[[float], None]:
        def put(fraction: float) -> None:  # called from the fetching thread
            loop.call_soon_threadsafe(fractions.put_nowait, (status, fraction))

        return put

    fetch_digest = hashlib.sha256(source.encode()).hexdigest()
    fetching, storing = progress(f"pulling {source}"), progress(f"storing in {MODELS_BUCKET}")
    adding = asyncio.ensure_future(add_model(ctx, card, fetching, storing))
    try:
        while not adding.done():
            got = asyncio.ensure_future(fractions.get())
            await asyncio.wait({adding, got}, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                continue
            # While fetching and storing, completed/total are per cent (the size is read from
            # the file).
            status, fraction = got.result()
            yield {
                "status": status,
                "digest": f"sha256:{fetch_digest}",
                "total": 100,
                "completed": round(fraction * 100),
            }
        adding.result()
    finally:
        adding.cancel()
    yield {"status": "verifying model"}
