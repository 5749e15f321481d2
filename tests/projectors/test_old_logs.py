"""A log written by an older Shoal replays to the rows that Shoal made of it.

`data/log_before_tools.jsonl` is a history's events as the code before tool calling,
structured output and log-probabilities wrote them (no `tools`, `logprobs`... fields), and
`data/log_before_tools.rows.json` the projection that code made of them. New fields have
defaults, so `shoal replay` of the same log must still give exactly those rows; tables and
columns added since then hold nothing but their defaults.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import MSG_ID_HEADER
from events.catalogue import ChunkGenerated, TaskCreated, parse_event
from projectors.rows import ROW_TYPES
from tests.projectors.helpers import db_rows_of

DATA = Path(__file__).parent / "data"
SHOAL = str(Path(sys.executable).parent / "shoal")


def _plain(rows: dict[str, list[dict[str, Any]]]) -> Any:
    def default(value: object) -> str:
        if isinstance(value, datetime):
            return value.isoformat()
        raise TypeError(type(value))

    return json.loads(json.dumps(rows, default=default, sort_keys=True))


def _as_recorded(rows: dict[str, list[dict[str, Any]]], recorded: Any) -> Any:
    """``rows`` with only the tables and columns of the recorded rows, after checking that
    what was added since holds only defaults: a new table no rows, a new column its row
    type's default."""
    defaults = {t.TABLE: {f.name: f.default for f in fields(t)} for t in ROW_TYPES}
    kept: dict[str, list[dict[str, Any]]] = {}
    for table, table_rows in rows.items():
        if table not in recorded:
            assert table_rows == [], f"a new table, {table}, has rows from an old log"
            continue
        columns = set(recorded[table][0]) if recorded[table] else set()
        for row in table_rows:
            for column in set(row) - columns:
                assert row[column] == defaults[table][column], (table, column, row[column])
        kept[table] = [{k: v for k, v in r.items() if k in columns} for r in table_rows]
    return kept


async def test_a_log_from_before_tool_calling_replays_to_the_same_rows(
    nats_server: EmbeddedNats, js: JetStreamContext, db_url: str
) -> None:
    lines = (DATA / "log_before_tools.jsonl").read_bytes().splitlines()
    for line in lines:
        event = parse_event(line)
        # The stored bytes as they are: what an old log holds, not what this code would write.
        await js.publish(event.subject, line, headers={MSG_ID_HEADER: event.event_id})
    events = [parse_event(line) for line in lines]
    tasks = [e for e in events if isinstance(e, TaskCreated)]
    assert tasks and all(t.tools == [] and t.logprobs is None for t in tasks)
    chunks = [e for e in events if isinstance(e, ChunkGenerated)]
    assert chunks and all(c.logprob is None and c.tool_calls == () for c in chunks)

    out = await asyncio.to_thread(
        subprocess.run,
        [SHOAL, "replay", "--nats", nats_server.url, "--db", db_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr

    expected = json.loads((DATA / "log_before_tools.rows.json").read_text())
    assert _as_recorded(_plain(await db_rows_of(db_url)), expected) == expected
