"""What `shoal up` shows while its model gets ready: weights, placement, then each runner.

``model_steps(state, model_id)`` is the pure part: from the projection to one ``Step`` per row.
``UpProgress`` draws the steps: rich progress bars on a terminal; elsewhere (a log file, a pipe,
a test) one plain line whenever a step's status changes, so that the output stays readable.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from events.states import INSTANCE_CURRENT, SERVING
from projectors.state import ClusterState

# What each runner state means to someone waiting for the model.
_RUNNER_STATUS = {
    "Assigned": "starting",
    "Downloading": "downloading weights",
    "Loading": "loading",
    "Ready": "ready",
    "Running": "ready",
    "Failed": "failed",
    "Stopped": "stopped",
}


@dataclass(frozen=True)
class Step:
    key: str  # stable across refreshes: one progress row each
    label: str
    status: str
    fraction: float | None  # 0..1; None: no measure of progress (a spinner)
    failed: bool = False


def weights_step(model_id: str, fraction: float | None, source: str) -> Step:
    """Fetching or assembling the weights on this machine (before the model is announced)."""
    done = fraction is not None and fraction >= 1.0
    return Step(
        "weights", f"{model_id} weights ({source})", "ready" if done else "preparing", fraction
    )


def model_steps(state: ClusterState, model_id: str) -> list[Step]:
    """The placement of each live instance of ``model_id``, and each of its runners."""
    steps: list[Step] = []
    for inst in sorted(state.instances(), key=lambda i: i.instance_id):
        if inst.model_id != model_id or inst.status not in INSTANCE_CURRENT:
            continue
        runners = sorted(state.runners_of(inst.instance_id), key=lambda r: (r.replica, r.rank))
        key = f"placement:{inst.instance_id}"
        label = f"placing {inst.instance_id}"
        if inst.status == "requested":
            steps.append(Step(key, label, "waiting for the planner", None))
        elif inst.status == "rejected":
            steps.append(Step(key, label, f"cannot be placed: {inst.reason}", None, failed=True))
        else:
            nodes = len({r.node_id for r in runners})
            where = f"{nodes} node{'s' if nodes != 1 else ''}" if runners else "its nodes"
            steps.append(Step(key, label, f"placed on {where}", 1.0))
        for r in runners:
            layers = f"layers {r.start_layer}-{r.end_layer - 1}" if r.end_layer else "all layers"
            status = _RUNNER_STATUS.get(r.state, r.state.lower())
            if r.state == "Failed" and r.error:
                status = f"failed: {r.error}"
            fraction: float | None = None
            if r.state in SERVING:
                fraction = 1.0
            elif r.state == "Downloading" and r.progress is not None:
                fraction = r.progress
            steps.append(
                Step(
                    f"runner:{r.runner_id}",
                    f"runner on {r.node_id} ({layers})",
                    status,
                    fraction,
                    failed=r.state == "Failed",
                )
            )
    return steps


class UpProgress:
    """Draws steps as they change. Use as a context manager; ``show`` replaces the rows."""

    def __init__(self, out: TextIO | None = None, *, terminal: bool | None = None) -> None:
        # ``terminal``: draw bars (True) or lines (False) whatever ``out`` is; None: ask it.
        self._console = Console(file=out or sys.stdout, force_terminal=terminal, highlight=False)
        self._live = self._console.is_terminal
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]✓[/]"),
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self._console,
        )
        self._rows: dict[str, TaskID] = {}
        self._said: dict[str, str] = {}

    def __enter__(self) -> UpProgress:
        if self._live:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live:
            self._progress.stop()

    def show(self, steps: list[Step]) -> None:
        for step in steps:
            if self._live:
                self._draw(step)
            elif self._said.get(step.key) != step.status:
                self._said[step.key] = step.status
                self._console.print(f"{step.label}: {step.status}", markup=False)

    def _draw(self, step: Step) -> None:
        status = f"[red]{step.status}[/]" if step.failed else step.status
        # A known fraction fills the bar; without one the bar pulses (total None).
        # Progress counts in thousandths: rich types them as ints.
        total = None if step.fraction is None else 1000
        completed = round((step.fraction or 0.0) * 1000)
        row = self._rows.get(step.key)
        if row is None:
            self._rows[step.key] = self._progress.add_task(
                step.label, total=total, completed=completed, status=status
            )
        else:
            self._progress.update(
                row, description=step.label, total=total, completed=completed, status=status
            )
