"""The checks of a request's schemas before a task is made of it (a 400 naming the field):
whether each can be turned into a grammar, and whether they are together not too much.

Pure Python: the API imports this module, and it must not load llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from structured.schema import prepare
from structured.schema_keywords import SchemaError

# What one schema, and one request's schemas together, may be (400s naming the field): the
# grammar llama.cpp's converter makes of an object grows as the cube of its optional
# properties (900 took 1.4 s), built before the task's first token. A schema's JSON text, and the
# properties of all a request's tools and its response format (an object's own:
# ``schema.py``'s ``MAX_PROPERTIES``).
MAX_SCHEMA_BYTES = 64 * 1024
MAX_TOTAL_PROPERTIES = 2048


def schema_problem(schema: object, lenient: bool = False) -> str | None:
    """Why ``schema`` cannot be turned into a grammar (for a 400), or None when it can
    (``lenient``: as a tool's parameters, best effort)."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        return (
            f"the JSON schema is {size} bytes, more than the {MAX_SCHEMA_BYTES} a schema may"
            " be here"
        )
    try:
        prepare(schema, lenient=lenient)
    except SchemaError as exc:
        return str(exc)
    return None


def property_count(schema: object) -> int:
    """The properties ``schema`` defines, at every depth (iterative: any nesting)."""
    count, stack = 0, [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found = item.get("properties")
            if isinstance(found, dict):
                count += len(found)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def schemas_problem(schemas: Mapping[str, object]) -> tuple[str, str] | None:
    """Why a request's schemas (by the field that holds each: ``tools.3.parameters``) are
    together too much to turn into grammars: the field that passes the bound, and why."""
    total = 0
    for field_name, schema in schemas.items():
        total += property_count(schema)
        if total > MAX_TOTAL_PROPERTIES:
            return field_name, (
                f"the request's schemas define more than {MAX_TOTAL_PROPERTIES} properties in"
                " all (its tools' parameters and its response format together): send fewer or"
                " smaller ones"
            )
    return None


def task_schemas(tools: list[Any], response_format: Any) -> dict[str, object]:
    """A task's schemas by the field that holds each (its tools' ``Tool`` records, its
    ``ResponseFormat``)."""
    found: dict[str, object] = {f"tools.{i}.parameters": t.parameters for i, t in enumerate(tools)}
    if response_format is not None and response_format.json_schema is not None:
        found["response_format"] = response_format.json_schema
    return found
