"""The tasks a runner is serving, noted for its worker."""

from __future__ import annotations

import json
from pathlib import Path

from events.attempts import attempt_of
from events.catalogue import TaskCreated
from services.runner.consumers import Pulled

# A task noted: its id, its model, and the attempt served (None: an embeddings request, or a
# file written before attempts were noted).
Noted = tuple[str, str, int | None]


class CurrentTasks:
    """The tasks a runner is serving, noted in a local file for its worker: a runner that dies
    (killed, or aborted by its engine) cannot say which tasks it leaves unfinished, and their
    TaskStarted may not have got out yet. Writing it costs a local write, not a round trip.
    Each task's attempt is noted too: a runner still serving an attempt continued since (it was
    stalled) leaves nothing for its worker to continue."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._tasks: dict[str, tuple[str, int | None]] = {}  # task id: model id, attempt

    def begin(self, task: Pulled) -> None:
        attempt = attempt_of(task).number if isinstance(task, TaskCreated) else None
        self._tasks[task.task_id] = (task.model_id, attempt)
        self._write()

    def end(self, task: Pulled) -> None:
        self._tasks.pop(task.task_id, None)
        self._write()

    def _write(self) -> None:
        if self._path is None:
            return
        if not self._tasks:
            self._path.unlink(missing_ok=True)
            return
        noted = [{"task_id": t, "model_id": m, "attempt": a} for t, (m, a) in self._tasks.items()]
        self._path.write_text(json.dumps(noted))

    @staticmethod
    def read(path: Path) -> list[Noted]:
        """(task id, model id, attempt) of each task left unfinished."""
        try:
            noted = json.loads(path.read_text())
            if isinstance(noted, dict):  # one task, as a runner of one slot wrote it before
                noted = [noted]
            return [
                (str(n["task_id"]), str(n["model_id"]), _attempt(n.get("attempt"))) for n in noted
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []


def _attempt(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
