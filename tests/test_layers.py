"""The rooms import one way (docs/architecture.md, "Layers"): each package imports only the
packages below it, and nothing outside the runner reaches into it. Read from the source (every
import statement, inside functions too), so that a lazy import running back up fails here
rather than in review."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_BASE = frozenset({"process", "events"})
_LIBRARIES = _BASE | {"modelfiles", "bus", "structured", "inference"}
# Each room, and the rooms of Shoal's it may import.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "process": frozenset(),
    "events": frozenset(),
    "scripts": frozenset(),
    "harness": frozenset({"events", "bus"}),
    "modelfiles": frozenset({"events"}),
    "bus": frozenset({"events"}),
    "structured": frozenset({"events"}),
    "inference": frozenset({"events", "modelfiles", "structured"}),
    # migrations/env.py, run by Alembic, reads the projection's tables: the one circle.
    "migrations": frozenset({"projectors"}),
    "projectors": _BASE | {"bus", "migrations"},
    "services": _LIBRARIES | {"projectors"},
    "api": _LIBRARIES | {"projectors", "services"},
    "cli": _LIBRARIES | {"projectors", "services", "api"},
}
ROOMS = frozenset(MAY_IMPORT) | {"bench", "tests"}
# What may be imported of the runner from outside it: the package (what a worker starts a
# runner with, and reads of one it outlived) and its entry point.
RUNNER_FACES = frozenset({"services.runner", "services.runner.main"})


def _imports(path: Path) -> Iterator[str]:
    """The modules ``path`` imports, dotted."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_rooms_import_only_those_below() -> None:
    wrong = [
        f"{path.relative_to(REPO)} imports {name}"
        for room, allowed in MAY_IMPORT.items()
        for path in sorted((REPO / room).rglob("*.py"))
        for name in sorted({m.split(".")[0] for m in _imports(path)} & ROOMS - allowed - {room})
    ]
    assert not wrong, wrong


def test_nothing_outside_the_runner_reaches_into_it() -> None:
    """Tests may: a runner's parts are tested where they are used (a tokenizer service under
    a real API, a runner's consumer named in a fault test)."""
    runner = REPO / "services" / "runner"
    wrong = [
        f"{path.relative_to(REPO)} imports {name}"
        for room in ROOMS - {"tests"}
        for path in sorted((REPO / room).rglob("*.py"))
        if not path.is_relative_to(runner)
        for name in sorted(set(_imports(path)))
        if name.startswith("services.runner") and name not in RUNNER_FACES
    ]
    assert not wrong, wrong


def test_benchmarks_share_only_bench_common() -> None:
    """A benchmark imports no test module and no other benchmark: what several share is in
    ``bench/common/`` (and what tests share with them in ``harness/``). A benchmark of several
    modules is a package (``bench/placement/``), which imports its own modules."""
    bench = REPO / "bench"
    wrong = []
    for path in sorted(bench.rglob("*.py")):
        parts = path.relative_to(bench).parts
        own = f"bench.{parts[0]}" if len(parts) > 1 else None  # a benchmark package's modules
        for name in sorted(set(_imports(path))):
            top, _, rest = name.partition(".")
            if top == "tests" or (
                top == "bench"
                and not (rest == "common" or rest.startswith("common."))
                and not (own and (name == own or name.startswith(own + ".")))
            ):
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, wrong
