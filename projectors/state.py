"""The cluster state as the projection holds it, in memory, and the changes rules make to it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from events.states import TASK_ENDED
from projectors.rows import (
    DeviceRow,
    InstanceRow,
    KeyRow,
    ModelRow,
    NodeRow,
    ResponseRow,
    Row,
    RunnerRow,
    TaskRow,
    UsageRow,
)


@dataclass(frozen=True, slots=True)
class Put:
    """Insert or replace ``row`` in its table."""

    row: Row

    @property
    def table(self) -> str:
        return self.row.TABLE

    @property
    def key(self) -> tuple[Any, ...]:
        return self.row.key()


@dataclass(frozen=True, slots=True)
class Delete:
    table: str
    key: tuple[Any, ...]


Change = Put | Delete


class ClusterState:
    """Every table of the projection, each a dict from primary key to its own row type."""

    def __init__(self) -> None:
        self.node_rows: dict[tuple[str], NodeRow] = {}
        self.device_rows: dict[tuple[str, str], DeviceRow] = {}
        self.model_rows: dict[tuple[str], ModelRow] = {}
        self.instance_rows: dict[tuple[str], InstanceRow] = {}
        self.runner_rows: dict[tuple[str], RunnerRow] = {}
        self.task_rows: dict[tuple[str], TaskRow] = {}
        self.response_rows: dict[tuple[str], ResponseRow] = {}
        self.key_rows: dict[tuple[str], KeyRow] = {}
        self.usage_rows: dict[tuple[str, str], UsageRow] = {}
        # The same dicts by table name, for changes, which name their table. Each row type has
        # a table of its own (its TABLE), so a row put through here lands in its typed dict.
        self._by_name: dict[str, dict[Any, Any]] = {
            NodeRow.TABLE: self.node_rows,
            DeviceRow.TABLE: self.device_rows,
            ModelRow.TABLE: self.model_rows,
            InstanceRow.TABLE: self.instance_rows,
            RunnerRow.TABLE: self.runner_rows,
            TaskRow.TABLE: self.task_rows,
            ResponseRow.TABLE: self.response_rows,
            KeyRow.TABLE: self.key_rows,
            UsageRow.TABLE: self.usage_rows,
        }

    @property
    def tables(self) -> Mapping[str, Mapping[tuple[Any, ...], Row]]:
        """Every table by name, read-only: for code that handles all tables alike."""
        return self._by_name

    # Typed look-ups used by the rules.
    def node(self, node_id: str) -> NodeRow | None:
        return self.node_rows.get((node_id,))

    def model(self, model_id: str) -> ModelRow | None:
        return self.model_rows.get((model_id,))

    def instance(self, instance_id: str) -> InstanceRow | None:
        return self.instance_rows.get((instance_id,))

    def runner(self, runner_id: str) -> RunnerRow | None:
        return self.runner_rows.get((runner_id,))

    def task(self, task_id: str) -> TaskRow | None:
        return self.task_rows.get((task_id,))

    def response(self, response_id: str) -> ResponseRow | None:
        return self.response_rows.get((response_id,))

    def api_key(self, key_id: str) -> KeyRow | None:
        return self.key_rows.get((key_id,))

    def usage(self, key_id: str, model_id: str) -> UsageRow | None:
        return self.usage_rows.get((key_id, model_id))

    def nodes(self) -> list[NodeRow]:
        return list(self.node_rows.values())

    def devices(self) -> list[DeviceRow]:
        return list(self.device_rows.values())

    def models(self) -> list[ModelRow]:
        return list(self.model_rows.values())

    def instances(self) -> list[InstanceRow]:
        return list(self.instance_rows.values())

    def runners(self) -> list[RunnerRow]:
        return list(self.runner_rows.values())

    def tasks(self) -> list[TaskRow]:
        return list(self.task_rows.values())

    def devices_of(self, node_id: str) -> Iterator[DeviceRow]:
        return (row for row in self.device_rows.values() if row.node_id == node_id)

    def runners_of(self, instance_id: str) -> Iterator[RunnerRow]:
        return (row for row in self.runner_rows.values() if row.instance_id == instance_id)

    def copy(self) -> ClusterState:
        """A copy whose tables can change without changing these (rows are immutable)."""
        other = ClusterState()
        for name, rows in self._by_name.items():
            other._by_name[name].update(rows)
        return other

    def rows(self, table: str) -> list[Row]:
        return list(self._by_name[table].values())

    def put(self, row: Row) -> None:
        self._by_name[row.TABLE][row.key()] = row

    def forget_history(self) -> None:
        """Let go of what is history rather than live: ended tasks and stored responses (the
        database keeps them; ``residency.py`` reads them back when an event names one)."""
        ended = [key for key, row in self.task_rows.items() if row.status in TASK_ENDED]
        for key in ended:
            del self.task_rows[key]
        self.response_rows.clear()

    def commit(self, changes: Iterable[Change]) -> None:
        """Make ``changes`` part of this state (the one place state is mutated)."""
        for ch in changes:
            if isinstance(ch, Put):
                self._by_name[ch.row.TABLE][ch.row.key()] = ch.row
            else:
                self._by_name[ch.table].pop(ch.key, None)


def collapse(changes: Iterable[Change]) -> dict[tuple[str, tuple[Any, ...]], Change]:
    """The last change per row: what a batch must write to storage."""
    return {(ch.table, ch.key): ch for ch in changes}
