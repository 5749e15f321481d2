"""An instance request checked against what the cluster knows, before anything is published:
what `POST /v1/instances`, `POST /v1/placement/preview`, `shoal instances create` and
`shoal placement preview` all ask. Pure: the projection and the request in, a
``PlacementRequest`` out, or ``RequestRefused`` naming the field at fault."""

from __future__ import annotations

from events.kinds import (
    DEFAULT_KV_CACHE,
    KV_CACHE_REQUESTS,
    Engine,
    InstanceRole,
    is_kv_cache_request,
    main_engine,
)
from events.records import Speculative
from projectors.state import ClusterState
from services.models.catalogue import builtin_cards
from services.planner.card_fit import card_info
from services.planner.kv_cache import kv_cache_problem
from services.planner.placement import ModelInfo, PlacementRequest, slots_problem
from services.planner.placement_spec import (
    PlacementSpecError,
    instance_role,
    parse_placement_spec,
)


class RequestRefused(ValueError):
    """Why the request cannot be made, and the field it is about (``placement``, ``role``,
    ``slots``, ``kv_cache``, ``model``): each caller words it in its own dialect (a 400 or
    404, an error line)."""

    def __init__(self, field: str, message: str, unknown_model: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.unknown_model = unknown_model


def model_info(state: ClusterState, model_id: str) -> ModelInfo | None:
    """What placement knows of a model: its own facts, or a catalogue card's estimate for one
    the cluster does not know yet; None for a model neither knows."""
    model = state.model(model_id)
    if model is not None:
        return ModelInfo.of(model)
    card = builtin_cards().get(model_id)
    return card_info(card) if card is not None else None


def placement_request(
    state: ClusterState,
    *,
    instance_id: str,
    model_id: str,
    spec: str | None = None,
    role: str | None = None,
    replicas: int = 1,
    context_length: int | None = None,
    slots: int | None = None,
    kv_cache: str = DEFAULT_KV_CACHE,
    speculative: Speculative | None = None,
) -> PlacementRequest:
    """The request as placement takes it; ``RequestRefused`` for a malformed placement, an
    unknown role or model, embeddings on an engine without them, slots the instance could
    not have, a KV-cache type that is unknown or that its engine cannot keep, or speculative
    decoding where its runners cannot do it."""
    try:
        parsed = parse_placement_spec(spec) if spec is not None else None
        chosen: InstanceRole = instance_role(spec, role)
    except PlacementSpecError as exc:
        raise RequestRefused("placement", f"invalid placement: {exc}") from None
    info = model_info(state, model_id)
    if info is None:
        raise RequestRefused(
            "model",
            f"the model `{model_id}` does not exist (nor is it in the catalogue:"
            " `shoal models list`)",
            unknown_model=True,
        )
    model = state.model(model_id)
    if chosen != "chat" and model is not None and main_engine(model.engines) == "mlx":
        what = "embeddings" if chosen == "embed" else "reranking"
        raise RequestRefused(
            "role", f"{model_id} runs on the mlx engine: {what} is not supported on it"
        )
    if slots is not None:
        in_spec = parsed.for_role(chosen).slots if parsed is not None else None
        if in_spec is not None and in_spec != slots:
            raise RequestRefused(
                "slots", f"slots: {slots}, but the placement gives {in_spec}: give it once"
            )
        if (problem := slots_problem(info, chosen, slots)) is not None:
            raise RequestRefused("slots", f"slots: {problem}")
    if not is_kv_cache_request(kv_cache):
        raise RequestRefused(
            "kv_cache", f"kv_cache: {kv_cache!r} is not one of {', '.join(KV_CACHE_REQUESTS)}"
        )
    if (problem := kv_cache_problem(info.engine, chosen, kv_cache)) is not None:
        raise RequestRefused("kv_cache", problem)
    if speculative is not None and (problem := speculative_problem(info.engine, chosen)):
        raise RequestRefused("speculative", problem)
    return PlacementRequest(
        instance_id=instance_id,
        model=info,
        replicas=replicas,
        context_length=context_length,
        spec=spec,
        role=chosen,
        slots=slots,
        kv_cache=kv_cache,
    )


def speculative_problem(engine: Engine, role: InstanceRole) -> str | None:
    """Why an instance's runners could not decode speculatively, or None: the llama.cpp
    engine's chat runners do (``inference/speculative.py``)."""
    if engine != "llamacpp":
        return f"speculative: the {engine} engine does not decode speculatively (llamacpp does)"
    if role != "chat":
        return f"speculative: an {role} instance generates no tokens to draft"
    return None
