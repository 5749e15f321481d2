"""A model's multimodal projector: the file beside its weights (an ``mmproj`` GGUF, marked
``WeightFile.projector``) with which llama.cpp reads images. It is stored and fetched as the
weights are, goes to the head of a pipeline with them (the head evaluates the images), and
counts in the memory placement gives the model. A model with one takes images. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from events.catalogue import WeightFile
from projectors.rows import ModelRow


def projector_of(files: Sequence[WeightFile]) -> WeightFile | None:
    """The projector among a model's files, if it has one."""
    return next((f for f in files if f.projector), None)


def weights_of(files: Sequence[WeightFile]) -> list[WeightFile]:
    """A model's files without its projector: the weights."""
    return [f for f in files if not f.projector]


def files_of(model: ModelRow) -> list[WeightFile]:
    """The files a projection's row names (none: its weights are at its path)."""
    return [WeightFile.model_validate(f) for f in model.files or [] if isinstance(f, dict)]


def model_projector(model: ModelRow) -> WeightFile | None:
    """The projector of a model the cluster knows."""
    return projector_of(files_of(model))


def projector_bytes(model: ModelRow) -> int:
    """What the model's projector adds to its weights (0: it has none)."""
    projector = model_projector(model)
    return projector.size if projector is not None else 0
