"""The cluster state as the projection holds it, in memory, and the changes rules make to it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from projectors.rows import (
    ROW_TYPES,
    DeviceRow,
    InstanceRow,
    ModelRow,
    NodeRow,
    Row,
    RunnerRow,
    TaskRow,
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


@dataclass
class ClusterState:
    """Every table of the projection as a dict from primary key to row."""

    tables: dict[str, dict[tuple[Any, ...], Row]] = field(
        default_factory=lambda: {t.TABLE: {} for t in ROW_TYPES}
    )

    # Typed look-ups used by the rules.
    def node(self, node_id: str) -> NodeRow | None:
        row = self.tables[NodeRow.TABLE].get((node_id,))
        return row if isinstance(row, NodeRow) else None

    def model(self, model_id: str) -> ModelRow | None:
        row = self.tables[ModelRow.TABLE].get((model_id,))
        return row if isinstance(row, ModelRow) else None

    def instance(self, instance_id: str) -> InstanceRow | None:
        row = self.tables[InstanceRow.TABLE].get((instance_id,))
        return row if isinstance(row, InstanceRow) else None

    def runner(self, runner_id: str) -> RunnerRow | None:
        row = self.tables[RunnerRow.TABLE].get((runner_id,))
        return row if isinstance(row, RunnerRow) else None

    def task(self, task_id: str) -> TaskRow | None:
        row = self.tables[TaskRow.TABLE].get((task_id,))
        return row if isinstance(row, TaskRow) else None

    def nodes(self) -> list[NodeRow]:
        return [r for r in self.tables[NodeRow.TABLE].values() if isinstance(r, NodeRow)]

    def models(self) -> list[ModelRow]:
        return [r for r in self.tables[ModelRow.TABLE].values() if isinstance(r, ModelRow)]

    def instances(self) -> list[InstanceRow]:
        rows = self.tables[InstanceRow.TABLE].values()
        return [r for r in rows if isinstance(r, InstanceRow)]

    def runners(self) -> list[RunnerRow]:
        return [r for r in self.tables[RunnerRow.TABLE].values() if isinstance(r, RunnerRow)]

    def devices_of(self, node_id: str) -> Iterator[DeviceRow]:
        for row in self.tables[DeviceRow.TABLE].values():
            if isinstance(row, DeviceRow) and row.node_id == node_id:
                yield row

    def runners_of(self, instance_id: str) -> Iterator[RunnerRow]:
        for row in self.tables[RunnerRow.TABLE].values():
            if isinstance(row, RunnerRow) and row.instance_id == instance_id:
                yield row

    def copy(self) -> ClusterState:
        """A copy whose tables can change without changing these (rows are immutable)."""
        return ClusterState({name: dict(rows) for name, rows in self.tables.items()})

    def rows(self, table: str) -> list[Row]:
        return list(self.tables[table].values())

    def commit(self, changes: Iterable[Change]) -> None:
        """Make ``changes`` part of this state (the one place state is mutated)."""
        for ch in changes:
            if isinstance(ch, Put):
                self.tables[ch.table][ch.key] = ch.row
            else:
                self.tables[ch.table].pop(ch.key, None)


def collapse(changes: Iterable[Change]) -> dict[tuple[str, tuple[Any, ...]], Change]:
    """The last change per row: what a batch must write to storage."""
    return {(ch.table, ch.key): ch for ch in changes}
