"""Which models take images: the one place that decides it, from what the cluster knows.

A GGUF model takes images when it has a projector file (its ``mmproj``, which llama.cpp's
runner loads beside the weights: ``services/models/projector.py``); an MLX model when its
directory holds a vision tower (``vision``: its config has a ``vision_config``; mlx-vlm reads
it). The projection's row says so once it is added, its catalogue card before (a request for a
card adds it on demand). Any other model's request with an image is a 400 that says so, in the
client's own dialect, rather than an answer about an image the model never saw. The model
lists say ``vision`` of the first.
"""

from __future__ import annotations

from events.kinds import Engine, main_engine
from projectors.rows import ModelRow
from services.models.cards import ModelCard
from services.models.projector import model_projector


def accepts_images(model: ModelRow | None, card: ModelCard | None) -> bool:
    """Whether a model's runners read images: the cluster's model (``model``) when it has
    one, else its catalogue ``card``."""
    if model is not None:
        return model.vision or model_projector(model) is not None
    return card is not None and (card.vision or card.projector is not None)


def engine_of(model: ModelRow | None, card: ModelCard | None) -> Engine:
    """The engine a model's runners use: the cluster's model's, else its card's."""
    if model is not None:
        return main_engine(model.engines)
    return main_engine(card.engines if card is not None else None)


def no_images(model_id: str, engine: Engine = "llamacpp") -> str:
    """Why a request with an image is refused for ``model_id`` (on ``engine``)."""
    if engine == "mlx":
        return (
            f"model {model_id} does not accept images: its MLX weights hold no vision tower"
            " (send text, or ask an MLX vision model: one converted with mlx-vlm, such as"
            " gemma3-4b:mlx-4bit)"
        )
    return (
        f"model {model_id} does not accept images: it reads text only (send text, or ask a"
        " vision model: one with a projector file, such as `shoal models add ID --mmproj FILE`)"
    )
