"""What the runner needs from an inference engine."""

from __future__ import annotations

from typing import Protocol

from bus.events import TaskCreated
from services.runner.generation import TokenSource


class EngineBroken(RuntimeError):
    """The engine cannot serve any more task (a pipeline lost a stage): the runner fails the
    task it was serving, then reports Failed and exits, to be restarted."""


class Engine(TokenSource, Protocol):
    @property
    def n_ctx(self) -> int: ...

    def prompt_tokens(self, task: TaskCreated) -> list[int]:
        """The task's messages through the model's chat template (or its plain prompt),
        tokenized. Raises ``InvalidRequest`` for a task it cannot serve."""
        ...
