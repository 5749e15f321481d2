"""GBNF grammars for structured output and tool calls, built with llama.cpp's own JSON schema
converter (``llama_cpp.llama_grammar.SchemaConverter``), from schemas ``schema.prepare`` made
safe for it.

The converter's Python port leaves out an integer's bounds, which its C++ original honours:
their rule is added here (``ranges.py``). Two of its defects are repaired for every grammar:
its ``char`` rule ``[^"\\\\]`` lets a JSON string hold raw control characters (a newline in a
string: invalid JSON), replaced by the C++ converter's ``[^"\\\\\\x7F\\x00-\\x1F]``; and its
literals escape no backslash, so that an ``enum`` value or property name with one came out wrong.

Grammars are built once per distinct request (``functools.lru_cache`` on the canonical JSON of
what shapes the grammar; key order kept, since it orders the properties), and llama.cpp is
imported on first use only: the API process imports this package and never builds a grammar.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
from collections.abc import Sequence
from typing import Any

from events.records import Tool
from structured.formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_CALLS,
    PYTHON_TAG,
    TRIGGERS,
    ToolFormatName,
)
from structured.ranges import integer_range
from structured.reply import Grammar
from structured.schema import prepare

# llama.cpp's C++ converter's rule: no control character, no DEL, unescaped.
SAFE_CHAR = (
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]'
    r" [0-9a-fA-F])"
)
OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
STRING_SCHEMA: dict[str, Any] = {"type": "string"}
_CACHE_SIZE = 256


def json_grammar(schema: dict[str, Any] | None) -> Grammar:
    """The reply is JSON that matches ``schema`` (None: any JSON object, as ``json_object``
    asks). Raises ``schema.SchemaError``."""
    return Grammar(_schema_gbnf(_key(OBJECT_SCHEMA if schema is None else schema)))


def tool_grammar(
    fmt: ToolFormatName,
    tools: Sequence[Tool],
    *,
    parallel: bool,
    lazy: bool,
    response: dict[str, Any] | None = None,
) -> Grammar:
    """The reply is a call (or, with ``parallel``, calls) of one of ``tools`` in ``fmt``'s
    syntax, the arguments matching the function's schema; or, with ``response``, JSON that
    matches it instead (for ``generic``, the ``{"response": ...}`` form). ``lazy``: the model
    writes freely until a call's marker, and the grammar holds from there (native formats).
    Raises ``schema.SchemaError``."""
    spec = {
        "format": fmt,
        "tools": [[t.name, t.parameters] for t in tools],
        "parallel": parallel,
        "response": response,
    }
    gbnf = _tools_gbnf(_key(spec))
    return Grammar(gbnf, TRIGGERS[fmt] if lazy else ())


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _key(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class _Builder:
    """One SchemaConverter for a whole grammar: every schema visited under its own prefix, so
    that rule names from different schemas never collide."""

    def __init__(self) -> None:
        self.module: Any = importlib.import_module("llama_cpp.llama_grammar")
        self.conv: Any = self.module.SchemaConverter(
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )
        self.conv._format_literal = _json_literal
        # The converter visits schemas through its own attribute: a bounded integer is ours.
        self._visit = self.conv.visit
        self.conv.visit = self._visit_bounded

    def _visit_bounded(self, schema: dict[str, Any], name: str) -> str:
        if schema.get("type") != "integer" or not ("minimum" in schema or "maximum" in schema):
            visited: str = self._visit(schema, name)
            return visited
        digits = integer_range(schema.get("minimum"), schema.get("maximum"))
        reserved = name in self.module.RESERVED_NAMES
        return self.rule(f"{name}-" if reserved else name or "root", f"({digits}) space")

    def schema(
        self, schema: dict[str, Any], prefix: str, top_object: bool = False, lenient: bool = False
    ) -> str:
        """The rule for JSON matching ``schema`` (``lenient``: a tool's, best effort)."""
        prepared = prepare(schema, prefix, top_object, lenient)
        self.conv.resolve_refs(prepared, prefix)
        name: str = self.conv.visit(prepared, f"{prefix}-json")
        return name

    def rule(self, name: str, body: str) -> str:
        key: str = self.conv._add_rule(name, body)
        return key

    def text(self) -> str:
        bad_char = self.module.PRIMITIVE_RULES["char"].content
        rules: dict[str, str] = self.conv._rules
        for name, body in rules.items():
            if body == bad_char:
                rules[name] = SAFE_CHAR
        text: str = self.conv.format_grammar()
        return text + "\n"


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _schema_gbnf(key: str) -> str:
    builder = _Builder()
    builder.rule("root", builder.schema(json.loads(key), "response"))
    return builder.text()


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _tools_gbnf(key: str) -> str:
    spec = json.loads(key)
    fmt: ToolFormatName = spec["format"]
    b = _Builder()
    lit = gbnf_literal
    name_key, type_key, function = lit('"name"'), lit('"type"'), lit('"function"')
    args_key = lit('"parameters"' if fmt == "llama3" else '"arguments"')
    calls = []
    for i, (name, parameters) in enumerate(spec["tools"]):
        args = b.schema(parameters, f"tool{i}", top_object=True, lenient=True)
        head = '"{" space'
        if fmt == "llama3":  # what its trigger lets through
            head = (
                f'"{{" [ \\t\\r\\n]{{0,4}} ({type_key} space ":" space {function} space "," space)?'
            )
        # The name first: the parser knows which function it is before the arguments come.
        body = f'{head} {name_key} space ":" space {lit(json.dumps(name))} space "," space'
        body += f' {args_key} space ":" space {args} "}}" space'
        calls.append(b.rule(f"call-{i}", body))
    call = b.rule("call", " | ".join(calls))
    several = spec["parallel"] and fmt != "llama3"
    items = f'{call} ("," space {call})*' if several else call
    if fmt == "hermes":
        one = b.rule("tool-call", f'{lit(HERMES_OPEN)} "\\n"? {call} "\\n"? {lit(HERMES_CLOSE)}')
        root = f'{one} ("\\n"? {one})*' if several else one
    elif fmt == "mistral":
        root = f'{lit(MISTRAL_CALLS)} space "[" space {items} "]" space'
    elif fmt == "llama3":
        root = f"({lit(PYTHON_TAG)} space)? {call}"
    else:
        tool_calls = lit('"tool_calls"')
        root = f'"{{" space {tool_calls} space ":" space "[" space {items} "]" space "}}" space'
    if spec["response"] is not None:
        answer = b.schema(spec["response"], "response")
        if fmt == "generic":
            response = lit('"response"')
            answer = f'"{{" space {response} space ":" space {answer} "}}" space'
        root = f"{b.rule('calls', root)} | {answer}"
    b.rule("root", root)
    return b.text()


def _json_literal(json_text: str) -> str:
    """The converter's literals (enum values, property names) are JSON texts: the model
    writes them as JSON would, with non-ASCII characters as they are (DEL escaped, as
    ``SAFE_CHAR`` wants it)."""
    with contextlib.suppress(ValueError):  # the converter only passes JSON texts
        json_text = json.dumps(json.loads(json_text), ensure_ascii=False)
    return gbnf_literal(json_text.replace("\x7f", "\\u007f"))
