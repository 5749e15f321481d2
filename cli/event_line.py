"""One readable line per event, for `shoal events tail`."""

from __future__ import annotations

from datetime import datetime

from events.catalogue import (
    Event,
    NodeTimedOut,
    PlacementRejected,
    RunnerStateChanged,
    TaskCreated,
    TaskFailed,
)

# Colour by kind of aggregate (rich markup).
_COLOURS = {
    "node": "cyan",
    "model": "blue",
    "instance": "magenta",
    "runner": "yellow",
    "task": "green",
    "chunk": "white",
}
_FAILURE_TYPES = (TaskFailed, PlacementRejected, NodeTimedOut)
_SKIP = {"event_id", "ts", "origin", "v", "type"}


def _short(value: object, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _part_ref(ref: dict[str, object]) -> str:
    """Parts stored apart (bus/stores/parts.py): how many, their size, the last one's digest."""
    return f"{ref['parts']}parts/{ref['bytes']}B@{str(ref['digest'])[:12]}"


def event_line(event: Event, seq: int | None = None, stored_at: datetime | None = None) -> str:
    """``#seq HH:MM:SS.mmm Type key=value ...`` with rich colour markup."""
    ts = (stored_at or event.ts).strftime("%H:%M:%S.%f")[:-3]
    colour = "red" if isinstance(event, _FAILURE_TYPES) else _COLOURS.get(event.aggregate, "white")
    if isinstance(event, RunnerStateChanged) and event.state == "Failed":
        colour = "red"
    name = event.type
    resumed = ""
    if isinstance(event, TaskCreated) and event.resume is not None:
        # A continuation: after how much, and why (its prompt is the first TaskCreated's).
        r = event.resume
        name, colour = "TaskCreated (resumed)", "yellow"
        resumed = (
            f"attempt={r.attempt} after={len(r.tokens)} tokens lost={r.runner_id} "
            f"why={_short(r.reason)} "
        )
    fields = resumed + " ".join(
        f"{k}={_part_ref(v) if k.endswith('_ref') else _short(v)}"
        for k, v in event.model_dump(exclude_none=True).items()
        if k not in _SKIP and k != "resume" and v not in ([], {}, "")
    )
    prefix = f"#{seq} " if seq is not None else ""
    return f"{prefix}[dim]{ts}[/dim] [bold {colour}]{name}[/] {_escape(fields)}"


def _escape(text: str) -> str:
    return text.replace("[", "\\[")
