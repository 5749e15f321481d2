"""`shoal state`: the current cluster state from the projection."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from datetime import datetime
from typing import Annotated, Any, Literal, assert_never

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from api.admission import AdmissionState
from cli.options import DEFAULT_DB, DbUrl
from events.states import (
    INSTANCE_STATUSES,
    NODE_STATUSES,
    RUNNER_STATES,
    TASK_STATUSES,
    InstanceStatus,
    NodeStatus,
    RunnerState,
    TaskStatus,
)
from events.units import GiB
from projectors import database
from projectors.store import table_rows

# What `shoal state` shows of each table (the JSON output has every column).
_COLUMNS: dict[str, tuple[str, ...]] = {
    "nodes": (
        "node_id",
        "status",
        "hostname",
        "advertised",
        "ram_available",
        "memory_offered",
        "cpu_count",
        "cpu_load",
        "last_seen",
    ),
    "instances": ("instance_id", "model_id", "status", "replicas", "slots", "placements", "reason"),
    "runners": (
        "runner_id",
        "instance_id",
        "node_id",
        "device",
        "state",
        "layers",
        "slots",
        "failures",
        "error",
    ),
    "tasks": (
        "task_id",
        "model_id",
        "status",
        "runner_id",
        "prompt_tokens",
        "completion_tokens",
        "ttft_ms",
        "tokens_per_s",
        "created_at",
    ),
}
_TABLES = ("nodes", "devices", "models", "instances", "runners", "tasks")
# What `shoal state` shows of an API's admission control (GET /v1/admission).
_ADMISSION = (
    "model",
    "capacity",
    "in_flight",
    "queued",
    "max_queued",
    "keys_waiting",
    "oldest_wait_s",
    "mean_wait_s",
    "admitted",
    "rejected",
)
DEFAULT_API = "http://127.0.0.1:8000"
ApiUrl = Annotated[
    str,
    typer.Option(
        envvar="SHOAL_API_URL",
        help="An API process whose admission queues to show"
        " too, if it answers (GET /v1/admission).",
    ),
]


def read_admission(api: str, key: str | None, timeout_s: float = 2.0) -> AdmissionState | None:
    """The API's ``GET /v1/admission``, or None when it does not answer (not running, another
    address, a wrong key): the projection alone is still shown."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{api.rstrip('/')}/v1/admission", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return AdmissionState.model_validate_json(answer.read())
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return None


async def read_state(db: str, recent_tasks: int) -> dict[str, list[dict[str, Any]]]:
    engine = database.create_engine(db)
    try:
        async with engine.connect() as conn:
            state = {name: await table_rows(conn, name) for name in _TABLES}
    finally:
        await engine.dispose()
    tasks = sorted(state["tasks"], key=lambda r: r["created_at"] or datetime.min, reverse=True)
    state["tasks"] = tasks[:recent_tasks]
    return state


# Statuses and states by what they mean to someone reading the table: working, on its way,
# wrong, over. Matched exhaustively, so that a new state without a style does not type-check.
Style = Literal["green", "yellow", "red", "dim"]


def style_of(value: NodeStatus | InstanceStatus | RunnerState | TaskStatus) -> Style:
    match value:
        case "online" | "placed" | "completed" | "Ready" | "Running" | "running":
            return "green"
        case "requested" | "Assigned" | "Downloading" | "Loading" | "pending" | "deleting":
            return "yellow"
        case "timed_out" | "rejected" | "failed" | "Failed":
            return "red"
        case "left" | "deleted" | "Stopped" | "cancelled":
            return "dim"
        case _:
            assert_never(value)


_STYLE_OF: dict[str, Style] = {
    s: style_of(s) for s in (*NODE_STATUSES, *INSTANCE_STATUSES, *RUNNER_STATES, *TASK_STATUSES)
}


def _styled(column: str, row: dict[str, Any]) -> Text:
    if column == "layers":  # a shard's layers, start..end inclusive
        start, end = row.get("start_layer"), row.get("end_layer")
        return Text(f"{start}-{end - 1}" if isinstance(start, int) and end else "-")
    text = _cell(column, row[column])
    if column in ("status", "state"):
        return Text(text, style=_STYLE_OF.get(text, ""))
    return Text(text)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, int) and column in ("ram_available", "memory_offered"):
        return f"{value / GiB:.1f} GiB"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def state(
    db: DbUrl = DEFAULT_DB,
    as_json: Annotated[bool, typer.Option("--json", help="All columns, as JSON.")] = False,
    tasks: Annotated[int, typer.Option(help="How many recent tasks to show.")] = 20,
    api: ApiUrl = DEFAULT_API,
    api_key: Annotated[
        str | None, typer.Option(envvar="SHOAL_API_KEY", help="Its key, if it has keys.")
    ] = None,
) -> None:
    """Print nodes, instances, runners and recent tasks, and the API's queues."""
    data = asyncio.run(read_state(db, tasks))
    admission = read_admission(api, api_key)
    if as_json:
        queues = admission.model_dump() if admission else None
        typer.echo(json.dumps(data | {"admission": queues}, default=str, indent=2))
        return
    console = Console()
    for name, columns in _COLUMNS.items():
        table = Table(title=f"{name} ({len(data[name])})", title_justify="left")
        for col in columns:
            table.add_column(col.replace("_", " "))
        for row in data[name]:
            table.add_row(*(_styled(c, row) for c in columns))
        console.print(table)
    if admission is not None:
        table = Table(title=f"admission ({api}, {admission.origin})", title_justify="left")
        for col in _ADMISSION:
            table.add_column(col.replace("_", " "))
        for model in admission.models:
            row = model.model_dump()
            table.add_row(*(_cell(c, row[c]) for c in _ADMISSION))
        console.print(table)
