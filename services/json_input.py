"""JSON that people write (a placement spec, a file of per-model defaults): read strictly, and
its values named in the messages that say what is wrong with them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def loads_strict(text: str, twice: Callable[[str], Exception]) -> Any:
    """``text`` decoded, refusing an object that gives a key twice (``json.loads`` would keep
    the last: a key written twice is almost certainly a mistake): ``twice(key)`` is raised."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise twice(key)
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=unique)


def kind(value: object) -> str:
    """A decoded JSON value, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    return "an object"
