"""`shoal state`: the current cluster state from the projection."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from projectors import database
from projectors.store import table_rows
from services.cli.options import DEFAULT_DB, DbUrl

GiB = 1024**3

# What `shoal state` shows of each table (the JSON output has every column).
_COLUMNS: dict[str, tuple[str, ...]] = {
    "nodes": ("node_id", "status", "hostname", "ram_available", "memory_offered", "cpu_count",
              "cpu_load", "last_seen"),
    "instances": ("instance_id", "model_id", "status", "replicas", "placements", "reason"),
    "runners": ("runner_id", "instance_id", "node_id", "device", "state", "layers",
                "failures", "error"),
    "tasks": ("task_id", "model_id", "status", "runner_id", "prompt_tokens",
              "completion_tokens", "ttft_ms", "tokens_per_s", "created_at"),
}  # fmt: skip
_TABLES = ("nodes", "devices", "models", "instances", "runners", "tasks")


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


# Statuses and states by what they mean to someone reading the table.
_STYLES = {
    "green": {"online", "placed", "completed", "Ready", "Running"},
    "yellow": {"requested", "Assigned", "Downloading", "Loading", "started", "created",
               "deleting"},
    "red": {"timed_out", "rejected", "failed", "Failed"},
    "dim": {"left", "deleted", "Stopped", "cancelled"},
}  # fmt: skip
_STYLE_OF = {value: style for style, values in _STYLES.items() for value in values}


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
) -> None:
    """Print nodes, instances, runners and recent tasks."""
    data = asyncio.run(read_state(db, tasks))
    if as_json:
        typer.echo(json.dumps(data, default=str, indent=2))
        return
    console = Console()
    for name, columns in _COLUMNS.items():
        table = Table(title=f"{name} ({len(data[name])})", title_justify="left")
        for col in columns:
            table.add_column(col.replace("_", " "))
        for row in data[name]:
            table.add_row(*(_styled(c, row) for c in columns))
        console.print(table)
