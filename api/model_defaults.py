"""Per-model defaults for models loaded on demand (``shoal api`` and ``shoal up``'s
``--model-defaults FILE``), as llama-server's router mode takes a file of per-model settings
(``--models-preset``) and Ollama a model's parameters: a JSON object keyed by the name a client
asks for the model by (an id, ``name:latest``, an alias), each entry with any of

- ``keep_alive``: how long an instance of it loaded on demand stays loaded once idle, as
  Ollama's ``keep_alive`` (seconds, ``"10m"``, ``"1h"``; ``0``: unloaded after each request;
  negative: kept, though still unloaded to make room). A request's own ``keep_alive`` wins.
- ``pinned``: ``true``: an instance of it loaded on demand is never unloaded, neither when idle
  nor to make room (as one asked for explicitly); not with ``keep_alive``.
- ``placement``: a placement spec (services/planner/placement_spec.py), as an object or as its
  JSON text: the instance of a role it has an entry for is placed so; another role's, as usual.
- ``context_length``: the context of its instances, in tokens.
- ``kv_cache``: the KV cache's type of its chat instances (``f16``, ``q8_0``, ``q4_0`` or
  ``auto``: see docs/runners.md); its embed and rerank instances keep f16.
- ``max_tokens``: the most tokens an answer from it has when its request sets no limit (as
  Ollama's ``num_predict`` in a Modelfile); wins over the API's ``--max-tokens``.
- ``speculative``: speculative decoding for its chat instances, as ``POST /v1/instances``
  takes it (``{"type": "ngram", "draft_max": 16}``; ``true``: the defaults); where its engine
  cannot (an MLX model), its instances are loaded without it and the API logs why.

Pure: text in, ``ModelDefaults`` out, or ``ModelDefaultsError`` naming the model and the key
at fault. Nothing here checks that a model exists (it may be added later) or that the
placement's nodes do (the planner does, when the model is loaded).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pydantic import ValidationError

from events.kinds import (
    DEFAULT_KV_CACHE,
    KV_CACHE_REQUESTS,
    InstanceRole,
    KvCacheRequest,
    is_kv_cache_request,
)
from events.records import INT32_MAX, Speculative
from services.json_input import kind, loads_strict
from services.planner.on_demand import parse_keep_alive
from services.planner.placement_spec import (
    PlacementSpec,
    PlacementSpecError,
    parse_placement_spec,
)

KEYS = (
    "keep_alive",
    "pinned",
    "placement",
    "context_length",
    "kv_cache",
    "max_tokens",
    "speculative",
)
EXAMPLE = (
    '{"qwen3-8b": {"keep_alive": "30m", "context_length": 8192}, "smollm2-135m": {"pinned": true}}'
)


class ModelDefaultsError(ValueError):
    """A defaults file that cannot be used; the message names the model and the key."""


@dataclass(frozen=True)
class ModelDefault:
    """One model's defaults (None, False: not given)."""

    keep_alive_s: float | None = None
    pinned: bool = False
    placement: PlacementSpec | None = None
    context_length: int | None = None
    max_tokens: int | None = None
    kv_cache: KvCacheRequest | None = None
    speculative: Speculative | None = None

    def kv_cache_for(self, role: InstanceRole) -> KvCacheRequest:
        """The KV cache's type of an instance in ``role``: this one's for chat, else f16."""
        return self.kv_cache if self.kv_cache is not None and role == "chat" else DEFAULT_KV_CACHE

    def placement_for(self, role: InstanceRole) -> str | None:
        """The placement of an instance in ``role``, as ``InstanceRequested.placement`` takes
        it: the spec's entry for that role alone; None when it has none (placed as usual)."""
        if self.placement is None or role not in self.placement.roles:
            return None
        return PlacementSpec({role: self.placement.roles[role]}).to_json()

    def keep_alive_for(self, asked_s: float | None) -> float | None:
        """The keep-alive of an instance loaded on demand: the request's own, else this one's
        (None: the planners' default)."""
        return asked_s if asked_s is not None else self.keep_alive_s


@dataclass(frozen=True)
class ModelDefaults:
    """Every model's defaults, by the name the file gives it."""

    by_name: Mapping[str, ModelDefault] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", MappingProxyType(dict(self.by_name)))

    def for_model(self, model_id: str, resolve: Callable[[str], str]) -> ModelDefault | None:
        """The defaults of ``model_id``: its own entry, else the first (by name) whose name
        ``resolve`` (the API's: aliases, ``:latest``) takes to it; None: it has none."""
        own = self.by_name.get(model_id)
        if own is not None:
            return own
        for name in sorted(self.by_name):
            if resolve(name) == model_id:
                return self.by_name[name]
        return None


def parse_model_defaults(text: str, aliases: Mapping[str, str] | None = None) -> ModelDefaults:
    """The defaults a file's ``text`` gives. ``aliases`` (the API's own, alias -> model id)
    tell two names of one model apart from two models: one model given defaults twice is
    refused."""
    try:
        data = loads_strict(
            text, lambda key: ModelDefaultsError(f"{key!r} is given twice in one object")
        )
    except ModelDefaultsError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ModelDefaultsError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDefaultsError(
            f"the file is a JSON object keyed by model name, e.g. {EXAMPLE}, not {kind(data)}"
        )
    named: dict[str, str] = {}  # model id -> the name that gave it defaults
    out: dict[str, ModelDefault] = {}
    for name, entry in data.items():
        if not name.strip() or name != name.strip():
            raise ModelDefaultsError(f"model {name!r}: a model's name, without spaces around it")
        model_id = _model_id(name, aliases or {})
        if model_id in named:
            raise ModelDefaultsError(
                f"models {named[model_id]!r} and {name!r} are the same model ({model_id}):"
                " give its defaults once"
            )
        named[model_id] = name
        try:
            out[name] = _entry(entry)
        except ModelDefaultsError as exc:
            raise ModelDefaultsError(f"model {name!r}: {exc}") from None
    return ModelDefaults(out)


def _entry(entry: object) -> ModelDefault:
    if not isinstance(entry, dict):
        raise ModelDefaultsError(
            f"its defaults are a JSON object with any of {', '.join(KEYS)}, e.g."
            f' {{"keep_alive": "10m"}}, not {kind(entry)}'
        )
    for key in entry:
        if key not in KEYS:
            raise ModelDefaultsError(f"unknown key {key!r} (allowed keys: {', '.join(KEYS)})")
    # null for a key means "not given", as when it is left out.
    keep = _keep_alive(entry.get("keep_alive"))
    pinned = _pinned(entry.get("pinned"))
    if pinned and keep is not None:
        raise ModelDefaultsError(
            "keep_alive: a pinned model is never unloaded: give keep_alive or pinned, not both"
        )
    return ModelDefault(
        keep_alive_s=keep,
        pinned=pinned,
        placement=_placement(entry.get("placement")),
        context_length=_tokens("context_length", entry.get("context_length")),
        max_tokens=_tokens("max_tokens", entry.get("max_tokens")),
        kv_cache=_kv_cache(entry.get("kv_cache")),
        speculative=_speculative(entry.get("speculative")),
    )


def _speculative(value: object) -> Speculative | None:
    if value is None or value is False:
        return None
    if value is True:
        return Speculative(type="ngram")
    if not isinstance(value, dict):
        raise ModelDefaultsError(f"speculative: an object or true, not {kind(value)}")
    try:
        return Speculative.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'speculative'}: {e['msg']}" for e in exc.errors()
        )
        raise ModelDefaultsError(f"speculative: {problems}") from None


def _keep_alive(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ModelDefaultsError(
            f'keep_alive: a duration (seconds, or such as "10m", "1h"), not {kind(value)}'
        )
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise ModelDefaultsError(f"keep_alive: {exc}") from None


def _pinned(value: object) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ModelDefaultsError(f"pinned: true or false, not {kind(value)}")
    return value


def _placement(value: object) -> PlacementSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict | str):
        raise ModelDefaultsError(
            f'placement: a placement spec, e.g. {{"chat": {{"devices": ["node-a:cpu"]}}}},'
            f" not {kind(value)}"
        )
    try:
        return parse_placement_spec(value if isinstance(value, str) else json.dumps(value))
    except PlacementSpecError as exc:
        raise ModelDefaultsError(f"placement: {exc}") from None


def _tokens(key: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
        raise ModelDefaultsError(f"{key}: a whole number of tokens, 1 or more, not {kind(value)}")
    return value


def _kv_cache(value: object) -> KvCacheRequest | None:
    if value is None:
        return None
    if not is_kv_cache_request(value):
        shown = repr(value) if isinstance(value, str) else kind(value)
        raise ModelDefaultsError(f"kv_cache: one of {', '.join(KV_CACHE_REQUESTS)}, not {shown}")
    return value


def _model_id(name: str, aliases: Mapping[str, str]) -> str:
    """The model ``name`` means, as far as the API's own aliases tell before the cluster's
    models are read (an id's ``:latest`` dropped, as the API drops it)."""
    for candidate in (name, name.removesuffix(":latest")):
        if candidate in aliases:
            return aliases[candidate]
    return name.removesuffix(":latest")
