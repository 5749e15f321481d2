"""A tool call identical to one the reply already made.

Allowed several calls, a small model may repeat one call until ``max_tokens`` (SmolLM2 does,
with ``tool_choice`` required): an agent would run it N times. The reply parser ends the reply
at the first call identical to an earlier one (``parsers.py``): that call is dropped, and
generation stops with ``tool_calls``. Two calls are identical when they have the same name and
the same arguments as JSON values: key order, whitespace and escapes do not count, and numbers
are compared as numbers (``1`` and ``1.0`` are one number), never with booleans.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from decimal import Decimal

# What makes calls identical: the name, and the arguments' JSON value in a comparable form.
CallKey = tuple[str, Hashable]


def call_key(name: str, arguments: str) -> CallKey | None:
    """The call's identity; None when its arguments are not JSON (a call cut off), which is
    identical to no other call."""
    try:
        value = json.loads(arguments, parse_float=Decimal, parse_int=Decimal)
    except ValueError:
        return None
    return name, _comparable(value)


def first_repeat(calls: Iterable[tuple[str, str]]) -> int | None:
    """The position of the first call, of (name, arguments) pairs, identical to an earlier one;
    None when all are distinct."""
    made: set[CallKey] = set()
    for i, (name, arguments) in enumerate(calls):
        key = call_key(name, arguments)
        if key is None:
            continue
        if key in made:
            return i
        made.add(key)
    return None


def _comparable(value: object) -> Hashable:
    """A JSON value as a hashable one that equals another only for the same JSON value. Each
    kind is tagged: Python takes ``True == 1``, JSON does not."""
    if isinstance(value, dict):
        return "object", frozenset((k, _comparable(v)) for k, v in value.items())
    if isinstance(value, list):
        return "array", tuple(_comparable(v) for v in value)
    if isinstance(value, Decimal):
        return "number", value
    if isinstance(value, str):
        return "string", value
    return "literal", repr(value)  # true, false, null; NaN and Infinity, which Python reads
