"""The names clients call models by: a model's id, an alias, ``name:latest``, or no name at all.

Clients send their own names (Claude Code sends Anthropic's model names, Ollama's clients add a
``:latest`` tag, llama-server's and vLLM's clients send none). An alias comes from an instance
request (``shoal up --alias``, ``"aliases"`` on ``POST /v1/instances``) or from the API's own
configuration (``SHOAL_MODEL_ALIASES``, ``shoal api --alias``); a request without a model goes
to the configured default, or to the only model served. A catalogue card not added yet is a
name too (``qwen3-8b:latest`` is ``qwen3-8b``): the model lists show it, and a request for it
adds and loads it (api/on_demand.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from api.errors import ApiError
from events.kinds import INSTANCE_ROLES, InstanceRole
from events.states import INSTANCE_ENDING
from projectors.state import ClusterState
from services.models.catalogue import builtin_cards


@dataclass(frozen=True)
class ModelNames:
    ids: frozenset[str] = frozenset()  # every model the cluster knows
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> model id
    served: Mapping[InstanceRole, tuple[str, ...]] = field(default_factory=dict)
    default: str | None = None
    catalogue: frozenset[str] = frozenset()  # the catalogue's cards, added or not

    def resolve(self, name: str | None, role: InstanceRole = "chat") -> str:
        """The model id ``name`` means. A name that is neither an id, an alias nor a catalogue
        card is returned as it is: the serving check answers it with a 404 that lists the
        known models."""
        if not name:
            return self._default(role)
        candidates = (name, name.removesuffix(":latest"))
        for candidate in candidates:
            if candidate in self.ids:
                return candidate
            if candidate in self.aliases:
                return self.aliases[candidate]
        for candidate in candidates:
            if candidate in self.catalogue:
                return candidate
        return name

    def _default(self, role: InstanceRole) -> str:
        if self.default:
            return self.resolve(self.default, role)
        served = self.served.get(role, ())
        if len(served) == 1:
            return served[0]
        if not served and len(self.ids) == 1:
            return next(iter(self.ids))  # known but not served: the serving check says why
        choices = ", ".join(served or sorted(self.ids)) or "none yet"
        raise ApiError(
            400,
            f"the request names no model and the cluster has no default one"
            f" (served: {choices}): send `model`, or start the API with"
            " --default-model",
            param="model",
            code="model_required",
        )

    def listed(self) -> list[tuple[str, str]]:
        """(name, model id) of every name a client may use: ids, then aliases."""
        return [(i, i) for i in sorted(self.ids)] + sorted(self.aliases.items())


def names_from(
    state: ClusterState, configured: Mapping[str, str], default: str | None
) -> ModelNames:
    """The names in the projection (models, live instances' aliases) and the API's own."""
    live = [i for i in state.instances() if i.status not in INSTANCE_ENDING]
    aliases = {a: i.model_id for i in live for a in i.aliases or []} | dict(configured)
    served: dict[InstanceRole, tuple[str, ...]] = {}
    for role in INSTANCE_ROLES:
        served[role] = tuple(sorted({i.model_id for i in live if i.role == role}))
    return ModelNames(
        frozenset(m.model_id for m in state.models()),
        aliases,
        served,
        default,
        frozenset(builtin_cards()),
    )


@dataclass
class NamesCache:
    """The names as last read, for ``ttl_s``: most requests name a model that was just served
    and never need them, the rest would read the projection each time."""

    ttl_s: float
    names: ModelNames | None = None
    read_at: float = 0.0

    def fresh(self) -> ModelNames | None:
        if self.names is not None and time.monotonic() - self.read_at < self.ttl_s:
            return self.names
        return None

    def keep(self, names: ModelNames) -> None:
        self.names, self.read_at = names, time.monotonic()
