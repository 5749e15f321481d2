"""Image generation, engine-neutral: what a task asks of an image engine, and the contract an
engine keeps (``ImageEngine``). An engine is one package in ``inference/engines/`` (diffusers'
is ``engines/diffusion/``); the runner (``services/runner/image_serve.py``) serves it.

The engine calls back between denoising steps, on its own thread: ``on_step`` with the
progress (image i of n, step j of m), and a partial image when one was asked for at that step;
``cancelled`` is asked after every step, and a cancelled generation raises
``GenerationCancelled`` there, within a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from events.records import ImageParams


class GenerationCancelled(Exception):
    """The task was cancelled (or its runner stops): raised between two steps."""


@dataclass(frozen=True)
class Progress:
    """Where a generation stands after a step: image ``image`` (0-based) of ``images``, step
    ``step`` (1-based) of ``steps``; ``partial`` is a PNG of the image so far, when one was asked
    for at this step."""

    image: int
    images: int
    step: int
    steps: int
    partial: bytes | None = None


@dataclass(frozen=True)
class GeneratedImage:
    index: int
    png: bytes
    width: int
    height: int
    seed: int


OnStep = Callable[[Progress], None]


class ImageEngine(Protocol):
    """What the runner needs of an image engine."""

    @property
    def default_steps(self) -> int:
        """The steps a task that names none gets."""
        ...

    def refusal(self, params: ImageParams) -> str | None:
        """Why the engine cannot honour ``params`` (naming the fields), or None."""
        ...

    def generate(
        self,
        prompt: str,
        params: ImageParams,
        on_step: OnStep,
        cancelled: Callable[[], bool],
    ) -> list[GeneratedImage]:
        """``params.n`` PNG images of ``params.width`` x ``params.height``, image i made with the
        seed ``params.seed + i`` (the same seed gives the same bytes on the same engine build).
        Raises ``GenerationCancelled`` after the step during which ``cancelled()`` became true."""
        ...


def partial_steps(steps: int, partials: int) -> frozenset[int]:
    """The steps (1-based) after which a partial image is made: ``partials`` of them spread
    evenly over the steps before the last (the last step's image is the finished one)."""
    if partials <= 0 or steps <= 1:
        return frozenset()
    count = min(partials, steps - 1)
    return frozenset(max(1, round((i + 1) * (steps - 1) / count)) for i in range(count))


def seed_of(params: ImageParams, index: int) -> int:
    """Image ``index``'s seed: the task's seed plus the index (a task without one has a seed
    chosen by the API, so that it is in the log: a retried task draws the same images)."""
    return ((params.seed or 0) + index) % (2**63)
