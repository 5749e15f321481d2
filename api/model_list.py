"""Every model a client can ask for, as the model lists show them (OpenAI's ``GET /v1/models``,
Anthropic's, Ollama's ``GET /api/tags``): the models the cluster knows and their aliases, then
the catalogue's cards not added yet (a request for one adds and loads it on demand:
api/on_demand.py), each saying whether it is added, whether an instance serves it now, and
what it can do (``vision``: it reads images).
Pure: the projection and the names in, the entries out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from api.images.vision import accepts_images
from api.model_names import ModelNames
from api.projection import loaded_models
from events.kinds import makes_images
from projectors.rows import ModelRow
from projectors.state import ClusterState
from services.models.cards import ModelCard


@dataclass(frozen=True)
class Askable:
    """A name a client may ask for, and the model it means."""

    name: str
    model_id: str
    model: ModelRow | None  # the cluster's, once added
    card: ModelCard | None  # its catalogue card, when it has one
    loaded: bool  # an instance serves it now

    @property
    def added(self) -> bool:
        """Whether the cluster knows the model (added, its weights fetched): else a catalogue
        card, added when first asked for."""
        return self.model is not None

    @property
    def vision(self) -> bool:
        """Whether it takes images (it has a projector file)."""
        return accepts_images(self.model, self.card)

    @property
    def capabilities(self) -> list[str]:
        """What the lists say it can do, in Ollama's words: generate, and read images; an image
        model's, that it makes images (``image``, as Ollama says of its image models)."""
        if self.model is not None and makes_images(self.model.engines):
            return ["image"]
        return ["completion", "vision"] if self.vision else ["completion"]

    @property
    def alias_of(self) -> str | None:
        return None if self.name == self.model_id else self.model_id

    @property
    def created(self) -> int:
        """When the model was added, in epoch seconds (0: not added, or not known when)."""
        added_at = self.model.added_at if self.model is not None else None
        return int(added_at.timestamp()) if added_at is not None else 0


def askable(
    state: ClusterState, names: ModelNames, cards: Mapping[str, ModelCard]
) -> list[Askable]:
    """The models the cluster knows and their aliases (``names.listed()``'s order; an alias of
    a model neither known nor a card is left out: nothing answers it), then every card not
    added, in the catalogue's order (one a name already means is left out)."""
    loaded = loaded_models(state)
    out: list[Askable] = []
    for name, model_id in names.listed():
        model, card = state.model(model_id), cards.get(model_id)
        if model is not None or card is not None:
            out.append(Askable(name, model_id, model, card, model_id in loaded))
    named = {a.name for a in out} | set(names.ids) | set(names.aliases)
    for card_id, card in cards.items():
        if card_id not in named:
            out.append(Askable(card_id, card_id, None, card, card_id in loaded))
    return out
