"""A task's images, read for the engine when the runner takes the task (their bytes are stored
as parts, the task names them: ``bus/stores/images.py``).

An engine that reads no images (a model without a projector file, an MLX model without a vision
tower, an MLX ring) refuses the task, as the API refuses it for a model that takes none
(``api/images/vision.py``): never served as if its images were not there. A llama.cpp instance
split over several nodes reads them at its head, which holds the projector (on its CPU) and
the first layers.
"""

from __future__ import annotations

from bus.stores.images import task_images
from bus.stores.parts import PartStore
from events.catalogue import TaskCreated
from events.images import images_of
from inference.engines.base import Engine, ReadsImages
from structured.reply import InvalidRequest


def image_refusal(engine: Engine, model_id: str) -> str | None:
    """Why ``engine`` (serving ``model_id``) reads no images; None: it reads them."""
    if not isinstance(engine, ReadsImages):
        return (
            f"model {model_id} does not accept images on this engine: images are read by"
            " llama.cpp with the model's projector file, or by a whole MLX vision model (an"
            " instance split over MLX ranks reads text only)"
        )
    why = engine.images_refused()
    return None if why is None else f"model {model_id} does not accept images: {why}"


def reads_images(engine: Engine) -> bool:
    """Whether ``engine`` reads images."""
    return isinstance(engine, ReadsImages) and engine.images_refused() is None


async def images_for(store: PartStore, engine: Engine, task: TaskCreated) -> dict[str, bytes]:
    """The bytes of the images of ``task`` (resolved: its messages in it), by digest, for an
    engine that reads them; ``InvalidRequest`` for one that does not."""
    if not images_of(task.messages or []):
        return {}
    why = image_refusal(engine, task.model_id)
    if why is not None:
        raise InvalidRequest(why)
    return await task_images(store, task.messages or [])
