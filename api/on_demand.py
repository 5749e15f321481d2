"""Loading a model on request: a request for a model the cluster knows (or a catalogue card
it can fetch) that no instance serves in the role asked asks the planner for one
(``InstanceRequested`` with ``on_demand``, and the request's route as its reason), then waits
until it serves: bounded by the API's ``load_timeout_s``, and a 503 at once, with the planner's
reason, when it cannot be placed.

Every API process names the instance alike: ``<model>-<role>-on-demand-<n>``, ``n`` the number
of on-demand instances of that model and role the projection has seen, so that many requests
for one cold model, on any number of API processes, cause one placement (one message id, and
the projection keeps the first request for an id). The planner unloads it once idle
(``services/planner/on_demand.py``). The API's per-model defaults (``--model-defaults``,
api/model_defaults.py) give its keep-alive (a request's own wins), its placement, its context,
or pin it: a pinned one is asked for as an explicit one is (``on_demand`` false), never
unloaded unless asked.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg
from pydantic import ValidationError

from api import keys, projection
from api.config import ApiConfig
from api.context import ApiContext
from api.errors import ApiError
from api.model_defaults import ModelDefault
from events.catalogue import InstanceRequested, RunnerStateChanged, parse_event
from events.kinds import InstanceRole, main_engine
from events.records import Speculative
from events.states import INSTANCE_CURRENT, STARTING
from events.subjects import aggregate_filter
from projectors.rows import InstanceRow
from projectors.state import ClusterState
from services.models.cards import ModelCard
from services.models.catalogue import builtin_cards
from services.planner.card_fit import fits_now
from services.planner.instance_request import speculative_problem

log = logging.getLogger(__name__)

# How often a request waiting for its model looks at the projection while nothing happens. An
# instance's event or a runner settling (Ready, Failed), heard live, brings the next look
# forward, and the looks after it come quickly until the projection has folded it.
POLL_S = 0.25
CATCH_UP_S = 0.005
CATCH_UP_FOR_S = 0.5
# How long the projection may take to show an instance once its InstanceRequested is stored.
PROJECTED_WITHIN_S = 30.0
# The refusals a model loaded on demand may answer: not known here (a catalogue card), served
# in another role only, no instance serving it (or one on its way).
LOADABLE = frozenset(
    {
        "model_not_found",
        "model_not_embedding",
        "model_not_chat",
        "model_not_reranker",
        "model_not_ready",
    }
)


def may_change_the_cluster(config: ApiConfig) -> bool:
    """Whether the request's key may unload, pin or download a model (``--on-demand``)."""
    return config.on_demand == "users" or keys.current().role == "admin"


def admin_only(what: str, model_id: str) -> ApiError:
    """The 403 of a user key asking for what changes the cluster for every key."""
    who = keys.current()
    return ApiError(
        403,
        f"{what} `{model_id}` changes the cluster for every key: an admin must do it (the key"
        f" {who.name!r} is a {who.role} key), or the operator lets users with `--on-demand"
        " users`",
        code="permission_denied",
    )


def downloadable(config: ApiConfig) -> dict[str, ModelCard]:
    """The catalogue's cards a request of this key may download (model lists show them as
    askable): all of them for an admin (or with ``--on-demand users``), none for a user."""
    return builtin_cards() if may_change_the_cluster(config) else {}


def require_may_keep(config: ApiConfig, model_id: str, keep_alive_s: float | None) -> None:
    """A keep-alive that pins a model (negative: for ever) or unloads it once idle (0, under
    other keys' requests too) is an admin's decision."""
    if keep_alive_s is None or keep_alive_s > 0 or may_change_the_cluster(config):
        return
    if keep_alive_s < 0:
        raise admin_only("keep_alive -1 (loaded for ever) for model", model_id)
    raise admin_only("keep_alive 0 (unloaded once idle) for model", model_id)


def instance_id_for(state: ClusterState, model_id: str, role: InstanceRole) -> str:
    """The id every API process gives the next on-demand instance of ``model_id`` in
    ``role``."""
    prefix = f"{model_id}-{role}-on-demand-"
    made = sum(
        1
        for i in state.instances()
        if i.model_id == model_id
        and i.role == role
        # A pinned one (per-model defaults) is not on demand, but it has one of these ids.
        and (i.on_demand or i.instance_id.startswith(prefix))
    )
    return f"{prefix}{made}"


def requested(
    state: ClusterState,
    model_id: str,
    role: InstanceRole,
    why: str,
    origin: str,
    keep_alive_s: float | None = None,
    defaults: ModelDefault | None = None,
) -> InstanceRequested:
    """The request for an instance of ``model_id`` in ``role`` that a request for it makes
    (``why``: the request; ``keep_alive_s``: its own keep-alive), with the model's
    ``defaults``: a pinned model's is not on demand (never unloaded unless asked)."""
    given = defaults or ModelDefault()
    return InstanceRequested(
        instance_id=instance_id_for(state, model_id, role),
        model_id=model_id,
        origin=origin,
        role=role,
        placement=given.placement_for(role),
        context_length=given.context_length,
        kv_cache=given.kv_cache_for(role),
        speculative=_speculative(state, model_id, role, given),
        on_demand=not given.pinned,
        keep_alive_s=None if given.pinned else given.keep_alive_for(keep_alive_s),
        reason=f"{why}; pinned (--model-defaults)" if given.pinned else why,
    )


def _speculative(
    state: ClusterState, model_id: str, role: InstanceRole, given: ModelDefault
) -> Speculative | None:
    """The defaults' speculative decoding, where the instance's runners can do it: the
    operator's file asked it of the model, not the client of its request, so an MLX model's
    instance loads without it (logged) rather than the request being refused."""
    model = state.model(model_id)
    if given.speculative is None or role != "chat" or model is None:
        return None
    problem = speculative_problem(main_engine(model.engines), role)
    if problem is not None:
        log.warning("model defaults of %s: %s; loaded without it", model_id, problem)
        return None
    return given.speculative


def loading(state: ClusterState, model_id: str, role: InstanceRole) -> bool:
    """Whether an instance of ``model_id`` in ``role`` is on its way (requested, or placed with
    runners not serving yet): a request waits for it rather than asking for another."""
    return any(
        i.model_id == model_id and i.role == role and i.status in ("requested", "placed")
        for i in state.instances()
    )


def unloadable(state: ClusterState, model_id: str) -> list[InstanceRow]:
    """The instances of ``model_id`` a client may unload (Ollama's ``keep_alive: 0``): those
    loaded on demand, still current."""
    return [
        i
        for i in state.instances()
        if i.on_demand and i.model_id == model_id and i.status in INSTANCE_CURRENT
    ]


def wanted(state: ClusterState, model_id: str, role: InstanceRole) -> bool:
    """Whether a request for ``model_id`` in ``role`` should ask for an instance: the model is
    known (or a catalogue card) and no instance of it in that role is current."""
    known = state.model(model_id) is not None or model_id in builtin_cards()
    current = any(
        i.model_id == model_id and i.role == role and i.status in INSTANCE_CURRENT
        for i in state.instances()
    )
    return known and not current


async def load(
    ctx: ApiContext,
    model_id: str,
    role: InstanceRole,
    why: str,
    keep_alive_s: float | None = None,
) -> None:
    """Ask for an instance of ``model_id`` in ``role`` (unless one is on its way) and wait
    until it serves; ``ApiError`` 503 when it cannot be placed, or does not load in time."""
    state = await projection.cluster(ctx.engine)
    if wanted(state, model_id, role):
        if state.model(model_id) is None:
            if not may_change_the_cluster(ctx.config):  # a download: up to tens of GB of disk
                raise admin_only(
                    f"Model `{model_id}` is not on this cluster's disks yet. Downloading", model_id
                )
            state = await _add_card(ctx, state, model_id)
        names = await ctx.model_names()
        defaults = ctx.config.model_defaults.for_model(model_id, names.resolve)
        event = requested(state, model_id, role, why, ctx.origin, keep_alive_s, defaults)
        await ctx.publish(event, msg_id=f"on-demand:{event.instance_id}")
        await _until_serving(ctx, model_id, role, asked=event.instance_id)
    else:
        await _until_serving(ctx, model_id, role)


async def _add_card(ctx: ApiContext, state: ClusterState, model_id: str) -> ClusterState:
    """A catalogue card's model, added (its weights fetched) once its card's estimate fits."""
    from api.model_adding import add_model  # the Hub's client: only an add needs it

    card = builtin_cards()[model_id]
    fits, why = fits_now(state, card)
    if not fits:
        raise ApiError(503, f"model `{model_id}` cannot be placed: {why}", code="model_not_ready")
    return await add_model(ctx, card)


async def _until_serving(
    ctx: ApiContext, model_id: str, role: InstanceRole, asked: str | None = None
) -> None:
    """Until the model serves in ``role``, while an instance of it is on its way (``asked``:
    the one just asked for, which the projection may not show yet)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.config.load_timeout_s
    projected_by = loop.time() + PROJECTED_WITHIN_S
    catch_up_until = 0.0
    settled = asyncio.Event()

    async def on_event(msg: Msg) -> None:  # an instance placed or refused, a runner settled
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if not isinstance(event, RunnerStateChanged) or event.state not in STARTING:
            settled.set()

    subs = [
        await ctx.nc.subscribe(subject, cb=on_event)
        for subject in (aggregate_filter("instance"), RunnerStateChanged.filter_for())
    ]
    try:
        while True:
            settled.clear()
            state = await projection.serving(ctx.engine, model_id, ctx.reader)
            try:
                projection.require_serving(state, model_id, role)
                return
            except ApiError as err:
                unseen = asked is not None and state.instance(asked) is None
                coming = loading(state, model_id, role) or (unseen and loop.time() < projected_by)
                if not coming or loop.time() > deadline:
                    if loop.time() > deadline:
                        err.message += f" (waited {ctx.config.load_timeout_s:g} s for it to load)"
                    raise
            if loop.time() < catch_up_until:
                await asyncio.sleep(CATCH_UP_S)
                continue
            try:
                await asyncio.wait_for(settled.wait(), POLL_S)
                catch_up_until = loop.time() + CATCH_UP_FOR_S
            except TimeoutError:
                pass
    finally:
        for sub in subs:
            await sub.unsubscribe()
