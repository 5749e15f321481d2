"""A task's images, read for the engine when the runner takes the task (their bytes are stored
as parts, the task names them: ``bus/images.py``).

No engine reads images yet (issue 36's engine step: llama.cpp's ``mtmd`` with the model's
projector file), so a task with images is refused here, as the API refuses it for a model that
does not take images (``api/images/vision.py``): never served as if its images were not there.
"""

from __future__ import annotations

from bus.events import TaskCreated
from bus.images import images_of, task_images
from bus.parts import PartStore
from services.runner.engines.base import Engine
from services.runner.generation import InvalidRequest


def reads_images(engine: Engine) -> bool:
    """Whether ``engine`` reads images: none does yet."""
    return False


async def images_for(store: PartStore, engine: Engine, task: TaskCreated) -> dict[str, bytes]:
    """The bytes of the images of ``task`` (resolved: its messages in it), by digest, for an
    engine that reads them; ``InvalidRequest`` for one that does not."""
    if not images_of(task.messages or []):
        return {}
    if not reads_images(engine):
        raise InvalidRequest(f"model {task.model_id} does not accept images")
    return await task_images(store, task.messages or [])
