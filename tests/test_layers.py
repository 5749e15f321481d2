"""The rooms import one way (docs/architecture.md, "Layers"): each package imports only the
packages below it. Read from the source (every import statement, inside functions too), so that
a lazy import running back up fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Each room, and the rooms of Shoal's it may import.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "process": frozenset(),
    "events": frozenset(),
    "bus": frozenset({"events"}),
    "structured": frozenset({"events"}),
}
ROOMS = frozenset(
    {"process", "events", "bus", "structured", "projectors", "services", "api", "cli", "migrations"}
)


def _imported(path: Path) -> set[str]:
    """The top-level packages ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_rooms_import_only_those_below() -> None:
    wrong = [
        f"{path.relative_to(REPO)} imports {name}"
        for room, allowed in MAY_IMPORT.items()
        for path in sorted((REPO / room).rglob("*.py"))
        for name in sorted(_imported(path) & ROOMS - allowed - {room})
    ]
    assert not wrong, wrong
