"""JSON schema's keywords as llama.cpp's ``SchemaConverter`` takes them: which it honours,
which constrain in ways it cannot, which belong to which type; and the checks of one
schema's keywords that need nothing else of it (``schema.py`` puts them together).

Pure Python, as ``schema.py``.
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import unquote

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def any_value() -> dict[str, Any]:
    """A schema for any JSON value that the converter reads as such (it takes ``{}`` for any
    object)."""
    return {"anyOf": [{"type": t} for t in TYPES if t != "integer"]}


# Keywords that constrain and that the converter cannot honour.
UNSUPPORTED = frozenset(
    {
        "multipleOf",
        "not",
        "if",
        "then",
        "else",
        "patternProperties",
        "propertyNames",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "minProperties",
        "maxProperties",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "additionalItems",
        "$dynamicRef",
        "$recursiveRef",
        "contentSchema",
    }
)
# The keywords honoured; the rest are annotations or unknown, ignored either way.
STRUCTURAL = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "pattern",
        "format",
        "minLength",
        "maxLength",
        *("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    }
)
OBJECT_WORDS = ("properties", "required", "additionalProperties")
ARRAY_WORDS = ("items", "prefixItems", "minItems", "maxItems")
STRING_WORDS = ("pattern", "format", "minLength", "maxLength")
NUMBER_WORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")


class SchemaError(ValueError):
    """A schema Shoal cannot honour; the message says which keyword, and where."""


def where(path: tuple[str | int, ...]) -> str:
    """A location in a schema, as messages name it: ``properties.age``, ``anyOf[1]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "the top level"


def pointer_path(pointer: str) -> tuple[str | int, ...]:
    if pointer == "#":
        return ()
    return tuple(unquote(p).replace("~1", "/").replace("~0", "~") for p in pointer[2:].split("/"))


def implied_type(s: dict[str, Any], path: tuple[str | int, ...], top_object: bool) -> str | None:
    kinds = [
        kind
        for kind, words in (
            ("object", OBJECT_WORDS),
            ("array", ARRAY_WORDS),
            ("string", STRING_WORDS),
            ("number", NUMBER_WORDS),
        )
        if any(w in s for w in words)
    ]
    if len(kinds) > 1:
        raise SchemaError(
            f"the JSON schema at {where(path)} has keywords of several types ({', '.join(kinds)})"
            " and no 'type': that is not supported"
        )
    if kinds:
        return kinds[0]
    return "object" if top_object else None


def for_type(s: dict[str, Any], kind: str) -> dict[str, Any]:
    words = {
        "object": OBJECT_WORDS,
        "array": ARRAY_WORDS,
        "string": STRING_WORDS,
        "integer": NUMBER_WORDS,
        "number": NUMBER_WORDS,
    }
    own = words.get(kind, ())
    others = {w for ws in words.values() for w in ws} - set(own)
    return {k: v for k, v in s.items() if k not in others} | {"type": kind}


def with_types(
    alternative: dict[str, Any], types: list[str], path: tuple[str | int, ...]
) -> dict[str, Any]:
    if "type" not in alternative:
        if any(k in alternative for k in ("$ref", "anyOf", "oneOf", "const", "enum")):
            return alternative  # what it refers to, or its values, say the type
        return {**alternative, "type": types if len(types) > 1 else types[0]}
    own = alternative["type"]
    own_list = own if isinstance(own, list) else [own]
    kept = [t for t in own_list if t in types]
    if not kept:
        raise SchemaError(
            f"the JSON schema at {where(path)} allows none of the types {types} that 'type'"
            " next to it requires"
        )
    return {**alternative, "type": kept if len(kept) > 1 else kept[0]}


def only_conditions(s: dict[str, Any]) -> bool:
    """Whether ``s``'s alternatives only say which properties are required, next to the
    object's own keywords."""
    alternatives = s.get("oneOf", s.get("anyOf"))
    return (
        any(k in s for k in OBJECT_WORDS)
        and isinstance(alternatives, list)
        and all(
            isinstance(a, dict) and set(a) <= {"required", "title", "description"}
            for a in alternatives
        )
    )


def integer_bound(
    s: dict[str, Any], key: str, exclusive: str, path: tuple[str | int, ...], upper: bool
) -> int | None:
    """The inclusive integer bound of ``key`` and ``exclusive`` (the tighter one)."""
    found: list[int] = []
    for name in (key, exclusive):
        value = s.get(name)
        if value is None or (name == exclusive and isinstance(value, bool)):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(f"{name} (at {where(path)}) must be a number")
        if not math.isfinite(value):
            raise SchemaError(f"{name} (at {where(path)}) must be a finite number")
        strict = name == exclusive or s.get(exclusive) is True  # draft 4: a flag
        if upper:
            bound = math.ceil(value) - 1 if strict else math.floor(value)
        else:
            bound = math.floor(value) + 1 if strict else math.ceil(value)
        found.append(bound)
    if not found:
        return None
    return min(found) if upper else max(found)


def check_bounds(
    low: int | None, high: int | None, low_key: str, high_key: str, path: tuple[str | int, ...]
) -> None:
    if low is not None and high is not None and high < low:
        raise SchemaError(f"{high_key} (at {where(path)}) is below {low_key}")


def check_json(value: object, path: tuple[str | int, ...]) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise SchemaError(f"{where(path)} must be JSON values") from None
