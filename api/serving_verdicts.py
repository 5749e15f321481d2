"""Which models this API process has just found able to answer, so that a busy API does not
ask the database again on every request."""

from __future__ import annotations

import time
from collections.abc import Callable

from events.kinds import InstanceRole


class ServingVerdicts:
    """Models found able to serve (a ready runner at the head of a live instance), remembered
    for ``ttl_s``. Every chat and completion request asks, and the database read is part of
    its time to first token.

    Only a yes is remembered: a model that becomes able to serve is seen by the next request.
    Every yes is forgotten when an instance is deleted (``forget``: a model unloaded on demand
    is loaded again by its next request, not refused). One that stops being able otherwise (its
    runner lost) is refused within ``ttl_s`` at the latest; a request accepted meanwhile gets
    its 503 from the task stream, which looks again (uncached) until the first token comes."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._found_at: dict[tuple[str, InstanceRole], float] = {}
        self._slots: dict[tuple[str, InstanceRole], int] = {}

    def fresh(self, model_id: str, role: InstanceRole = "chat") -> bool:
        """Whether ``model_id`` was found able to serve (in ``role``) less than ``ttl_s``
        ago."""
        found_at = self._found_at.get((model_id, role))
        return found_at is not None and self._clock() - found_at < self._ttl_s

    def slots(self, model_id: str, role: InstanceRole = "chat") -> int | None:
        """The slots ``model_id`` was found to serve with (api/admission.py's capacity), while
        the verdict is ``fresh``; None when it is not."""
        return self._slots.get((model_id, role), 1) if self.fresh(model_id, role) else None

    def found(self, model_id: str, role: InstanceRole = "chat", slots: int = 1) -> None:
        if self._ttl_s > 0:
            self._found_at[(model_id, role)] = self._clock()
            self._slots[(model_id, role)] = slots

    def forget(self) -> None:
        """Ask the database again for every model (an instance is being deleted)."""
        self._found_at.clear()
