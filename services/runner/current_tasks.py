"""The tasks a runner is serving, noted for its worker."""

from __future__ import annotations

import json
from pathlib import Path

from services.runner.consumers import Pulled


class CurrentTasks:
    """The tasks a runner is serving, noted in a local file for its worker: a runner that dies
    (killed, or aborted by its engine) cannot say which tasks it leaves unfinished, and their
    TaskStarted may not have got out yet. Writing it costs a local write, not a round trip."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._tasks: dict[str, str] = {}  # task id: model id

    def begin(self, task: Pulled) -> None:
        self._tasks[task.task_id] = task.model_id
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
        noted = [{"task_id": t, "model_id": m} for t, m in self._tasks.items()]
        self._path.write_text(json.dumps(noted))

    @staticmethod
    def read(path: Path) -> list[tuple[str, str]]:
        """(task id, model id) of each task left unfinished."""
        try:
            noted = json.loads(path.read_text())
            if isinstance(noted, dict):  # one task, as a runner of one slot wrote it before
                noted = [noted]
            return [(str(n["task_id"]), str(n["model_id"])) for n in noted]
        except (OSError, ValueError, KeyError, TypeError):
            return []
