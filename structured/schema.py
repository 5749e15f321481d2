"""Which JSON schemas Shoal can turn into a grammar, and the schema the converter is given.

llama.cpp's Python ``SchemaConverter`` honours some keywords, ignores others silently and
fails on a few shapes (an empty ``anyOf``, ``minLength`` without a type, ``items: {}``...).
``prepare`` checks a schema against what it really does and rewrites it into a shape it
converts faithfully; ``schema_problem`` (``schema_checks.py``) says, for a 400, why a schema
cannot be honoured. ``schema_keywords.py`` has the tables of keywords and the checks of one.

Honoured: ``type`` (a name or a list of them), ``properties``, ``required``,
``additionalProperties`` (true, false or a schema), ``items`` (a schema, or a list: a tuple),
``prefixItems``, ``minItems``, ``maxItems``, ``enum``, ``const``, ``anyOf``, ``oneOf`` (taken as
``anyOf``), ``allOf`` (of object schemas, merged into one), ``$ref`` (local: ``#`` or ``#/...``;
recursion is fine), ``$defs``/``definitions``, ``pattern`` (see ``pattern.py``), ``format``
(``date``, ``time``, ``date-time``, ``uuid``; ignored on non-string types), ``minLength``,
``maxLength``, and an ``integer``'s ``minimum``, ``maximum``, ``exclusiveMinimum`` and
``exclusiveMaximum`` (``ranges.py``). Annotations (``title``, ``description``, ``default``,
``examples``...) and keywords JSON schema does not define are ignored. Any other keyword that
constrains (a ``number``'s bounds, ``not``, ``uniqueItems``, ``propertyNames``...) is refused,
and so is a keyword the converter would ignore next to another (``maxLength`` next to
``pattern``, ``properties`` next to ``anyOf``), a ``format`` it does not know and a length or
count above ``MAX_REPEAT``.

That is for a structured output (``response_format``), whose schema is a contract. A tool's
parameters are best effort, as llama.cpp's converter and the hosted APIs take them
(``lenient``): what the grammar can express is constrained, and a keyword it cannot express
is left out of the grammar (the model still reads it in the tool's description, which keeps
the whole schema) rather than refused; ``dropped`` says which. What remains refused there is
a schema that is not one (a keyword of the wrong kind, a ``$ref`` to nothing, left recursion).

The grammar is sometimes stricter than the schema (never looser): an object holds no
properties the schema does not name unless ``additionalProperties`` allows them, its
properties come in the schema's order, the required ones first, and an ``allOf`` object holds
all its properties.

Pure Python: the API imports this module, and it must not load llama.cpp.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from structured.pattern import MAX_REPEAT, PatternError, converter_pattern
from structured.schema_keywords import (
    ARRAY_WORDS,
    FORMATS,
    NUMBER_WORDS,
    OBJECT_WORDS,
    STRUCTURAL,
    TYPES,
    UNSUPPORTED,
    SchemaError,
    any_value,
    check_bounds,
    check_json,
    for_type,
    implied_type,
    integer_bound,
    only_conditions,
    pointer_path,
    where,
    with_types,
)

_MAX_DEPTH = 64
# An object's properties (``schema_checks.py`` has the other bounds, and why).
MAX_PROPERTIES = 256


def dropped(schema: object) -> list[str]:
    """What a tool's grammar leaves out of ``schema``: each keyword, where (``properties.url
    .format``); ``schema`` is one ``schema_problem(schema, lenient=True)`` accepts."""
    preparer = _Preparer(schema, "s", lenient=True)
    preparer.run(top_object=True)
    return list(dict.fromkeys(preparer.dropped))


def prepare(
    schema: object, prefix: str = "s", top_object: bool = False, lenient: bool = False
) -> dict[str, Any]:
    """``schema`` rewritten for llama.cpp's ``SchemaConverter``: only the keywords it honours,
    in the shapes it converts faithfully, every ``$ref`` pointing to ``#/$defs/<prefix>-defN``
    (rule names unique to this schema when it is visited under a name other than
    ``<prefix>-defN``, so that two schemas in one grammar cannot mix their definitions), an
    integer's bounds as inclusive ``minimum``/``maximum`` (``grammar.py`` makes their rule).
    ``top_object``: the schema describes an object even without ``"type"`` (a function's
    parameters). ``lenient``: a keyword the grammar cannot express is left out rather than
    refused (a tool's parameters). Raises ``SchemaError``."""
    return _Preparer(schema, prefix, lenient).run(top_object)


@dataclass
class _Preparer:
    root: object
    prefix: str
    lenient: bool = False
    # What a lenient preparation left out, each keyword where it was.
    dropped: list[str] = field(default_factory=list)
    refs: dict[str, str] = field(default_factory=dict)  # pointer -> definition name
    defs: dict[str, Any] = field(default_factory=dict)
    queue: list[tuple[str, tuple[str | int, ...]]] = field(default_factory=list)
    # Per definition, the definitions it can reach without writing a character first.
    leading: dict[str, set[str]] = field(default_factory=dict)

    def run(self, top_object: bool) -> dict[str, Any]:
        out = self.node(self.root, (), 0, top_object)
        while self.queue:
            pointer, path = self.queue.pop()
            name = self.refs[pointer]
            target = self.resolve(pointer, path)
            self.defs[name] = prepared = self.node(target, pointer_path(pointer), 0, False)
            self.leading[name] = self._leads(prepared)
        self._check_cycles()
        if self.defs:
            out = {**out, "$defs": self.defs}
        return out

    # --- one schema -------------------------------------------------------------------

    def node(
        self, schema: object, path: tuple[str | int, ...], depth: int, top_object: bool = False
    ) -> dict[str, Any]:
        if depth > _MAX_DEPTH:
            raise SchemaError(f"the JSON schema nests too deeply (at {where(path)})")
        if not isinstance(schema, dict):
            raise SchemaError(
                f"the JSON schema at {where(path)} is not an object"
                + (
                    " (boolean schemas are supported for additionalProperties only)"
                    if isinstance(schema, bool)
                    else ""
                )
            )
        for key in schema:
            if key in UNSUPPORTED:
                self.drop(
                    key,
                    path,
                    f"the JSON schema keyword {key!r} (at {where(path)}) is not supported",
                )
        for key in ("$defs", "definitions"):
            if key in schema and not isinstance(schema[key], dict):
                raise SchemaError(f"{key} (at {where(path)}) must be an object")
        s = {k: v for k, v in schema.items() if k in STRUCTURAL}
        types = self.types(s, path)
        if self.lenient and ("oneOf" in s or "anyOf" in s) and only_conditions(s):
            # Alternatives that only say which properties are required (one of a or b):
            # the grammar keeps the object and leaves the condition out.
            key = "oneOf" if "oneOf" in s else "anyOf"
            self.dropped.append(f"{where((*path, key))}")
            s = {k: v for k, v in s.items() if k not in ("oneOf", "anyOf")}
        if "$ref" in s:
            return self.ref(s, path)
        if "oneOf" in s or "anyOf" in s:
            return self.union(s, types, path, depth)
        if "const" in s or "enum" in s:
            return self.constant(s, path)
        if len(types) > 1:
            # The converter would forget every other keyword: one alternative per type,
            # each with the keywords that apply to it.
            alternatives = [self.node(for_type(s, t), path, depth + 1) for t in types]
            return {"anyOf": alternatives}
        kind = types[0] if types else implied_type(s, path, top_object)
        if kind is None:
            if "allOf" in s:
                return self.all_of(s, path, depth)
            return any_value()
        if "allOf" in s:
            if kind != "object":
                raise SchemaError(
                    f"the JSON schema keyword 'allOf' (at {where(path)}) is supported for"
                    " objects only"
                )
            return self.all_of(s, path, depth)
        if kind == "object":
            return self.obj(s, path, depth)
        if kind == "array":
            return self.array(s, path, depth)
        if kind == "string":
            return self.string(s, path)
        if kind == "integer":
            return self.integer(s, path)
        for key in NUMBER_WORDS:
            if key in s:
                self.drop(
                    key,
                    path,
                    f"the JSON schema keyword {key!r} (at {where(path)}) is not supported for"
                    f" a {kind} (an integer's bounds are)",
                )
        self.only(s, {"type", "format", *NUMBER_WORDS}, path, "type")
        return {"type": kind}

    def types(self, s: dict[str, Any], path: tuple[str | int, ...]) -> list[str]:
        if "type" not in s:
            return []
        value = s["type"]
        names = value if isinstance(value, list) else [value]
        if not names or not all(isinstance(t, str) for t in names):
            raise SchemaError(f"'type' (at {where(path)}) must be a type name or a list of them")
        for name in names:
            if name not in TYPES:
                raise SchemaError(f"the JSON schema type {name!r} (at {where(path)}) is unknown")
        if len(set(names)) != len(names):
            raise SchemaError(f"'type' (at {where(path)}) names a type twice")
        return list(names)

    def ref(self, s: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
        s = self.only(s, {"$ref"}, path, "$ref")
        pointer = s["$ref"]
        if not isinstance(pointer, str):
            raise SchemaError(f"$ref (at {where(path)}) must be a string")
        if pointer != "#" and not pointer.startswith("#/"):
            raise SchemaError(
                f"the JSON schema $ref {pointer!r} (at {where(path)}) is not supported: only"
                " references inside the schema ('#/...') are"
            )
        if pointer not in self.refs:
            self.resolve(pointer, path)  # fails early, with the place that refers
            self.refs[pointer] = f"{self.prefix}-def{len(self.refs)}"
            self.queue.append((pointer, path))
        return {"$ref": f"#/$defs/{self.refs[pointer]}"}

    def resolve(self, pointer: str, path: tuple[str | int, ...]) -> object:
        target = self.root
        for raw in pointer[2:].split("/") if pointer != "#" else []:
            part = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(
                    f"the JSON schema $ref {pointer!r} (at {where(path)}) points to nothing"
                )
        return target

    def union(
        self, s: dict[str, Any], types: list[str], path: tuple[str | int, ...], depth: int
    ) -> dict[str, Any]:
        if "oneOf" in s and "anyOf" in s:
            raise SchemaError(
                f"the JSON schema keywords 'anyOf' and 'oneOf' (at {where(path)}) are not"
                " supported together"
            )
        key = "oneOf" if "oneOf" in s else "anyOf"
        s = self.only(s, {key, "type"}, path, key)
        alternatives = s[key]
        if not isinstance(alternatives, list) or not alternatives:
            raise SchemaError(f"{key} (at {where(path)}) must be a non-empty list of schemas")
        out = []
        for i, alternative in enumerate(alternatives):
            if types and isinstance(alternative, dict):
                # 'type' next to anyOf applies to every alternative: give it to them.
                alternative = with_types(alternative, types, (*path, key, i))
            out.append(self.node(alternative, (*path, key, i), depth + 1))
        return {"anyOf": out}

    def constant(self, s: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
        if "const" in s:
            s = self.only(s, {"const", "type"}, path, "const")
            check_json(s["const"], (*path, "const"))
            return {"const": s["const"]}
        s = self.only(s, {"enum", "type"}, path, "enum")
        values = s["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"enum (at {where(path)}) must be a non-empty list")
        check_json(values, (*path, "enum"))
        return {"enum": values}

    def obj(self, s: dict[str, Any], path: tuple[str | int, ...], depth: int) -> dict[str, Any]:
        s = self.only(s, {"type", *OBJECT_WORDS}, path, "type")
        properties = s.get("properties", {})
        if not isinstance(properties, dict):
            raise SchemaError(f"properties (at {where(path)}) must be an object")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"required (at {where(path)}) must be a list of property names")
        missing = [r for r in required if r not in properties]
        if missing and not self.lenient:
            raise SchemaError(
                f"required (at {where(path)}) names {missing[0]!r}, which properties does not"
                " define: that is not supported"
            )
        if missing:
            self.dropped.append(where((*path, "required")))
            required = [r for r in required if r in properties]
        if len(properties) > MAX_PROPERTIES:
            raise SchemaError(
                f"properties (at {where(path)}) defines {len(properties)} properties, more"
                f" than the {MAX_PROPERTIES} an object may have here"
            )
        out: dict[str, Any] = {"type": "object"}
        out["properties"] = {
            name: self.node(sub, (*path, "properties", name), depth + 1)
            for name, sub in properties.items()
        }
        if required:
            out["required"] = list(dict.fromkeys(required))
        if "additionalProperties" in s:
            extra = s["additionalProperties"]
            if extra is True:
                out["additionalProperties"] = True
            elif isinstance(extra, dict):
                out["additionalProperties"] = self.node(
                    extra, (*path, "additionalProperties"), depth + 1
                )
            elif extra is not False:
                raise SchemaError(
                    f"additionalProperties (at {where(path)}) must be true, false or a schema"
                )
        elif "properties" not in s:
            return {"type": "object"}  # any object
        if out.get("additionalProperties") is True and not out["properties"]:
            return {"type": "object"}
        return out

    def all_of(self, s: dict[str, Any], path: tuple[str | int, ...], depth: int) -> dict[str, Any]:
        s = self.only(s, {"type", "allOf"}, path, "allOf")
        parts = s["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError(f"allOf (at {where(path)}) must be a non-empty list of schemas")
        properties: dict[str, Any] = {}
        required: list[str] = []
        for i, part in enumerate(parts):
            for name, sub, needed in self._components(part, (*path, "allOf", i), 0):
                if name in properties and properties[name] != sub:
                    raise SchemaError(
                        f"allOf (at {where(path)}) defines the property {name!r} twice"
                        " differently: that is not supported"
                    )
                properties[name] = sub
                if needed:
                    required.append(name)
        merged = {"type": "object", "properties": properties, "required": required}
        return self.obj(merged, path, depth)

    def _components(
        self, part: object, path: tuple[str | int, ...], hops: int
    ) -> Iterator[tuple[str, Any, bool]]:
        """The properties an allOf member brings, with whether each is required."""
        if hops > _MAX_DEPTH:
            raise SchemaError(f"allOf (at {where(path)}) refers to itself")
        if not isinstance(part, dict):
            raise SchemaError(f"the JSON schema at {where(path)} is not an object")
        if isinstance(part.get("$ref"), str):
            pointer = part["$ref"]
            if pointer != "#" and not pointer.startswith("#/"):
                raise SchemaError(
                    f"the JSON schema $ref {pointer!r} (at {where(path)}) is not supported:"
                    " only references inside the schema ('#/...') are"
                )
            yield from self._components(self.resolve(pointer, path), path, hops + 1)
            return
        if "allOf" in part:
            for i, sub in enumerate(part["allOf"] if isinstance(part["allOf"], list) else []):
                yield from self._components(sub, (*path, "allOf", i), hops + 1)
            return
        kind = self.types({k: v for k, v in part.items() if k == "type"}, path)
        structural = {k for k in part if k in STRUCTURAL} - {"type"}
        if kind not in ([], ["object"]) or not structural <= {"properties", "required"}:
            raise SchemaError(
                f"allOf (at {where(path)}) is supported for object schemas with properties"
                " and required only"
            )
        properties = part.get("properties", {})
        required = part.get("required", [])
        if not isinstance(properties, dict):
            raise SchemaError(f"properties (at {where(path)}) must be an object")
        if not isinstance(required, list):
            raise SchemaError(f"required (at {where(path)}) must be a list of property names")
        for name, sub in properties.items():
            yield name, sub, name in required

    def array(self, s: dict[str, Any], path: tuple[str | int, ...], depth: int) -> dict[str, Any]:
        s = self.only(s, {"type", *ARRAY_WORDS}, path, "type")
        items = s.get("items")
        prefix = s.get("prefixItems")
        tuple_items = prefix if prefix is not None else (items if isinstance(items, list) else None)
        if tuple_items is not None:
            if not isinstance(tuple_items, list):
                raise SchemaError(f"prefixItems (at {where(path)}) must be a list of schemas")
            if prefix is not None and items not in (None, False):
                raise SchemaError(
                    f"the JSON schema keyword 'items' (at {where(path)}) is not supported"
                    " alongside 'prefixItems' (only items: false is)"
                )
            for key in ("minItems", "maxItems"):
                if key in s:
                    raise SchemaError(
                        f"the JSON schema keyword {key!r} (at {where(path)}) is not supported"
                        " for a tuple (prefixItems)"
                    )
            if not tuple_items:
                raise SchemaError(f"prefixItems (at {where(path)}) must not be empty")
            key = "prefixItems" if prefix is not None else "items"
            return {
                "type": "array",
                "prefixItems": [
                    self.node(item, (*path, key, i), depth + 1)
                    for i, item in enumerate(tuple_items)
                ],
            }
        low = self.count(s, "minItems", path)
        high = self.count(s, "maxItems", path)
        if items is False:
            raise SchemaError(f"items: false (at {where(path)}) is not supported")
        if items is None or items is True:
            if low is None and high is None:
                return {"type": "array"}
            item = any_value()
        else:
            item = self.node(items, (*path, "items"), depth + 1)
        out: dict[str, Any] = {"type": "array", "items": item}
        if low:
            out["minItems"] = low
        if high is not None:
            out["maxItems"] = high
        check_bounds(low, high, "minItems", "maxItems", path)
        return out

    def string(self, s: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
        if "pattern" in s:
            pattern = s["pattern"]
            if not isinstance(pattern, str):
                raise SchemaError(f"pattern (at {where(path)}) must be a string")
            try:
                converted = converter_pattern(pattern)
            except PatternError as exc:
                self.drop(
                    "pattern",
                    path,
                    f"the JSON schema pattern {pattern!r} (at {where(path)}) is not supported:"
                    f" {exc}",
                )
                return self.string({k: v for k, v in s.items() if k != "pattern"}, path)
            self.only(s, {"type", "pattern"}, path, "pattern")
            return {"type": "string", "pattern": converted}
        if "format" in s:
            name = s["format"]
            if name not in FORMATS:
                self.drop(
                    "format",
                    path,
                    f"the JSON schema format {name!r} (at {where(path)}) is not supported"
                    f" (supported: {', '.join(FORMATS[:4])})",
                )
                return self.string({k: v for k, v in s.items() if k != "format"}, path)
            self.only(s, {"type", "format"}, path, "format")
            return {"type": "string", "format": name}
        s = self.only(s, {"type", "minLength", "maxLength"}, path, "type")
        low = self.count(s, "minLength", path)
        high = self.count(s, "maxLength", path)
        check_bounds(low, high, "minLength", "maxLength", path)
        out: dict[str, Any] = {"type": "string"}
        if low:
            out["minLength"] = low
        if high is not None:
            out["maxLength"] = high
        return out

    def integer(self, s: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
        """An integer, its bounds made inclusive integers (``exclusiveMinimum`` as a number,
        or draft 4's boolean next to ``minimum``)."""
        s = self.only(s, {"type", "format", *NUMBER_WORDS}, path, "type")
        low = integer_bound(s, "minimum", "exclusiveMinimum", path, upper=False)
        high = integer_bound(s, "maximum", "exclusiveMaximum", path, upper=True)
        if low is not None and high is not None and low > high:
            raise SchemaError(f"no integer is within the bounds at {where(path)}")
        out: dict[str, Any] = {"type": "integer"}
        if low is not None:
            out["minimum"] = low
        if high is not None:
            out["maximum"] = high
        return out

    # --- what cannot be honoured ------------------------------------------------------

    def drop(self, key: str, path: tuple[str | int, ...], message: str) -> None:
        """``key`` cannot be honoured: refused (``message``), or (lenient) left out of the
        grammar."""
        if not self.lenient:
            raise SchemaError(message)
        self.dropped.append(where((*path, key)))

    def only(
        self, s: dict[str, Any], honoured: set[str], path: tuple[str | int, ...], main: str
    ) -> dict[str, Any]:
        """``s`` with the keywords the converter honours next to ``main``; another one is
        refused, or (lenient) left out."""
        for key in s:
            if key not in honoured:
                self.drop(
                    key,
                    path,
                    f"the JSON schema keyword {key!r} (at {where(path)}) is not supported"
                    f" alongside {main!r}",
                )
        return {k: v for k, v in s.items() if k in honoured}

    def count(self, s: dict[str, Any], key: str, path: tuple[str | int, ...]) -> int | None:
        """A length or count: one above ``MAX_REPEAT`` is refused, or (lenient) no bound."""
        if key not in s:
            return None
        value = s[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SchemaError(f"{key} (at {where(path)}) must be a non-negative integer")
        if value > MAX_REPEAT:
            if not self.lenient:
                raise SchemaError(
                    f"{key} {value} (at {where(path)}) is not supported: at most {MAX_REPEAT}"
                )
            self.dropped.append(where((*path, key)))
            return None
        return value

    # --- $ref cycles ------------------------------------------------------------------

    def _leads(self, schema: dict[str, Any]) -> set[str]:
        """Definitions ``schema`` may start with (before writing a character)."""
        if "$ref" in schema:
            return {schema["$ref"].rsplit("/", 1)[-1]}
        out: set[str] = set()
        for alternative in schema.get("anyOf", []):
            out |= self._leads(alternative)
        return out

    def _check_cycles(self) -> None:
        # A definition that can start with itself is left recursion, which llama.cpp refuses.
        names = {v: k for k, v in self.refs.items()}
        for name in self.leading:
            seen: set[str] = set()
            todo = list(self.leading[name])
            while todo:
                at = todo.pop()
                if at == name:
                    raise SchemaError(
                        f"the JSON schema $ref {names[name]!r} refers to itself before"
                        " anything is written (left recursion): that is not supported"
                    )
                if at not in seen:
                    seen.add(at)
                    todo.extend(self.leading.get(at, ()))
