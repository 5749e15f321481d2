"""Which JSON schemas can be honoured (``schema_problem``), and that everything accepted
converts into a grammar llama.cpp parses and that takes the schema's instances."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from events.records import Tool
from structured.grammar import json_grammar, tool_grammar
from structured.schema import dropped, prepare
from structured.schema_checks import schema_problem
from structured.schema_keywords import where
from tests.structured import oracle

ACCEPTED: list[dict[str, Any]] = [
    {},
    {"type": "object"},
    {"type": "string", "title": "A", "description": "d", "default": "x", "examples": ["y"]},
    {"type": ["string", "null"]},
    {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "integer", "format": "int64"},
    {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
    {"type": "integer", "exclusiveMinimum": 0},
    {"type": ["integer", "null"], "minimum": -3, "exclusiveMaximum": 10.5},
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "number"}},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "minItems": 2},
    {"type": "array", "items": {}},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}], "items": False},
    {"type": "array", "items": [{"type": "string"}, {"type": "boolean"}]},
    {"enum": ["a", 1, None, {"k": "v"}]},
    {"const": "fixed", "type": "string"},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
    {"type": "object", "oneOf": [{"properties": {"a": {"type": "string"}}}]},
    {"type": "object", "anyOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"properties": {}}}},
    {
        "allOf": [
            {"properties": {"a": {"type": "string"}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}},
        ]
    },
    {"type": "string", "pattern": "^[a-z]+\\d{2}$"},
    {"type": "string", "format": "date-time"},
    {"format": "uuid"},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"minLength": 1},
    {"$defs": {"A": {"type": "string"}}, "$ref": "#/$defs/A"},
    {"definitions": {"A": {"type": "string"}}, "properties": {"a": {"$ref": "#/definitions/A"}}},
    {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
    {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "x",
        "$comment": "c",
        "type": "boolean",
        "deprecated": True,
        "readOnly": False,
        "x-unknown": 1,
    },
]

REFUSED: list[tuple[object, str]] = [
    (
        {"type": "object", "properties": {"age": {"type": "number", "minimum": 0}}},
        "the JSON schema keyword 'minimum' (at properties.age) is not supported for a number",
    ),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "no integer is within the bounds"),
    ({"type": "integer", "minimum": "1"}, "minimum (at the top level) must be a number"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "'propertyNames'"),
    ({"type": "number", "multipleOf": 2}, "'multipleOf' (at the top level)"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"if": {}, "then": {}}, "'if'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "patternProperties": {"a": {}}}, "'patternProperties'"),
    ({"type": "object", "minProperties": 1}, "'minProperties'"),
    (
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
        "$ref 'https://example.com/s.json' (at properties.a) is not supported",
    ),
    ({"$ref": "#/$defs/Missing"}, "points to nothing"),
    ({"type": "string", "format": "email"}, "format 'email' (at the top level) is not supported"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "lookarounds"),
    ({"type": "string", "pattern": "\\bword"}, "word boundaries"),
    ({"type": "string", "pattern": 'say "hi"'}, "JSON must escape"),
    ({"type": "string", "pattern": "a{2,1}"}, "backwards"),
    ({"type": "string", "pattern": "(a*)*"}, "can match nothing"),
    ({"type": "string", "pattern": "^a$b"}, "only supported at its start"),
    (
        {"type": "string", "pattern": "^a", "maxLength": 3},
        "'maxLength' (at the top level) is not supported alongside 'pattern'",
    ),
    ({"type": "fraction"}, "type 'fraction' (at the top level) is unknown"),
    ({"type": []}, "'type' (at the top level) must be"),
    ({"properties": []}, "properties (at the top level) must be an object"),
    ({"properties": {"a": {}}, "required": "a"}, "required (at the top level) must be a list"),
    ({"properties": {"a": {}}, "required": ["b"]}, "names 'b', which properties does not"),
    ({"type": "object", "properties": {"a": 3}}, "the JSON schema at properties.a is not an"),
    ({"type": "array", "items": True, "maxItems": -1}, "maxItems (at the top level) must be"),
    ({"type": "string", "maxLength": 5000}, "at most 1000"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength (at the top level) is below"),
    ({"anyOf": []}, "anyOf (at the top level) must be a non-empty list"),
    ({"enum": []}, "enum (at the top level) must be a non-empty list"),
    (
        {"anyOf": [{"type": "string"}], "properties": {}},
        "'properties' (at the top level) is not supported alongside 'anyOf'",
    ),
    ({"type": "object", "properties": {"a": {}}, "allOf": [{}]}, "'allOf'"),
    (
        {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
        "refers to itself before anything is written",
    ),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "left recursion"),
    ({"type": "array", "prefixItems": [{}], "items": {"type": "string"}}, "'items'"),
    ({"properties": {"a": {}}, "items": {}}, "keywords of several types"),
    ({"type": "string", "additionalProperties": False}, "'additionalProperties'"),
    ({"type": "string", "anyOf": [{"type": "number"}]}, "allows none of the types ['string']"),
    ({"allOf": [{"type": "string"}]}, "allOf (at allOf[0]) is supported for object schemas"),
    ([], "the JSON schema at the top level is not an object"),
    ({"type": "object", "properties": {"a": True}}, "boolean schemas are supported for"),
]


@pytest.mark.parametrize("schema", ACCEPTED, ids=lambda s: json.dumps(s)[:60])
def test_accepted_schemas_convert_into_grammars_llama_cpp_parses(schema: dict[str, Any]) -> None:
    assert schema_problem(schema) is None
    grammar = json_grammar(schema)
    assert oracle.parses(grammar.gbnf), grammar.gbnf


@pytest.mark.parametrize(("schema", "message"), REFUSED, ids=lambda v: str(v)[:50])
def test_refused_schemas_say_which_keyword_and_where(schema: object, message: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None
    assert message in problem


def test_paths_read_as_in_the_messages() -> None:
    assert where(()) == "the top level"
    assert where(("properties", "a", "anyOf", 1, "items")) == "properties.a.anyOf[1].items"


def test_the_problem_is_found_deep_inside() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"anyOf": [{"type": "string"}, {"type": "number", "multipleOf": 3}]},
            }
        },
    }
    assert schema_problem(schema) == (
        "the JSON schema keyword 'multipleOf' (at properties.tags.items.anyOf[1]) is not supported"
    )


@pytest.mark.parametrize(
    ("low", "high"), [(0, None), (1, None), (-5, 5), (None, -3), (3, 17), (10, 100), (-120, 9)]
)
def test_an_integer_s_bounds_are_the_grammar_s(low: int | None, high: int | None) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    if low is not None:
        schema["minimum"] = low
    if high is not None:
        schema["exclusiveMaximum"] = high + 1  # the exclusive form: the same integers
    grammar = json_grammar(schema)
    for n in range(-250, 250):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert oracle.accepts(grammar, str(n)) == inside, (n, grammar.gbnf)
    assert not oracle.accepts(grammar, "-0")
    assert not oracle.accepts(grammar, "007" if low is None or low <= 7 else "0" + str(low))
    assert oracle.accepts(grammar, "123456789012") == (high is None)


@given(st.integers(-(10**6), 10**6), st.integers(0, 10**6), st.integers(-(10**7), 10**7))
@settings(max_examples=60, deadline=None)
def test_integer_bounds_hold_anywhere(low: int, width: int, n: int) -> None:
    grammar = json_grammar({"type": "integer", "minimum": low, "maximum": low + width})
    assert oracle.accepts(grammar, str(n)) == (low <= n <= low + width)


# What Claude Code's and Codex's tools carry, and a lenient preparation (a tool's
# parameters) leaves out rather than refuses.
LEFT_OUT: list[tuple[dict[str, Any], list[str]]] = [
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, ["propertyNames"]),
    (
        {"type": "object", "properties": {"url": {"type": "string", "format": "uri"}}},
        ["properties.url.format"],
    ),
    (
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 524288}}},
        ["properties.s.maxLength"],
    ),
    (
        {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}},
        ["properties.x.minimum"],
    ),
    (
        {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}},
        ["properties.t.uniqueItems"],
    ),
    (
        {
            "type": "object",
            "properties": {"p": {"type": "string", "pattern": "^a", "maxLength": 3}},
        },
        ["properties.p.maxLength"],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        ["anyOf"],
    ),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "zz"]}, ["required"]),
]


@pytest.mark.parametrize(("schema", "left_out"), LEFT_OUT, ids=lambda v: str(v)[:50])
def test_a_tool_s_parameters_are_best_effort(schema: dict[str, Any], left_out: list[str]) -> None:
    assert schema_problem(schema) is not None  # a response_format's schema stays strict
    assert schema_problem(schema, lenient=True) is None
    assert dropped(schema) == left_out
    grammar = tool_grammar(
        "generic", [Tool(name="f", parameters=schema)], parallel=False, lazy=False
    )
    assert oracle.parses(grammar.gbnf)


def test_what_a_tool_s_grammar_still_refuses_says_where() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}
    assert schema_problem(schema, lenient=True) == (
        "the JSON schema $ref '#/$defs/nope' (at properties.a) points to nothing"
    )


def test_a_tool_s_bounded_integer_is_held_and_its_left_out_keyword_not() -> None:
    schema = {
        "type": "object",
        "properties": {
            "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
            "url": {"type": "string", "format": "uri"},
        },
        "required": ["offset", "url"],
    }
    grammar = tool_grammar(
        "generic", [Tool(name="f", parameters=schema)], parallel=False, lazy=False
    )
    call = '{"tool_calls": [{"name": "f", "arguments": {"offset": %s, "url": "no uri"}}]}'
    assert oracle.accepts(grammar, call % "12")
    assert not oracle.accepts(grammar, call % "-1")
    assert not oracle.accepts(grammar, call % "1.5")


def test_schema_problem_does_not_load_llama_cpp() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from structured.schema_checks import schema_problem\n"
        "import structured\n"
        "assert schema_problem({'type': 'object'}) is None\n"
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Colour(StrEnum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    street: str
    city: str = Field(description="The city")
    zip: str | None = None


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=40)
    age: int | None = None
    colour: Colour = Colour.RED
    home: Address
    others: list[Address] = []


def test_a_pydantic_schema_with_a_nested_model_an_optional_and_an_enum() -> None:
    schema = Person.model_json_schema()
    assert "$defs" in schema  # the nested model and the enum are references
    assert schema_problem(schema) is None
    grammar = json_grammar(schema)
    person = Person(
        name="Ada",
        age=36,
        colour=Colour.GREEN,
        home=Address(street="1 Main St", city="Paris"),
        others=[Address(street="b", city="c", zip="75001")],
    )
    dumped = person.model_dump(mode="json")
    # The grammar has the required properties first (the converter's order), then the rest.
    ordered = {k: dumped[k] for k in ("name", "home", "age", "colour", "others")}
    assert oracle.accepts(grammar, json.dumps(ordered))
    assert oracle.accepts(grammar, json.dumps(ordered, separators=(",", ":")))
    assert not oracle.accepts(grammar, person.model_dump_json())  # pydantic's order
    assert oracle.accepts(grammar, '{"name": "Bo", "home": {"street": "s", "city": "c"}}')
    assert not oracle.accepts(grammar, '{"name": "Bo", "colour": "blue", "home": {}}')
    assert not oracle.accepts(grammar, '{"name": "", "home": {"street": "s", "city": "c"}}')
    assert not oracle.accepts(grammar, '{"home": {"street": "s", "city": "c"}}')


def test_definitions_get_names_of_their_own() -> None:
    prepared = prepare({"$defs": {"A": {"type": "string"}}, "$ref": "#/$defs/A"}, "tool3")
    assert prepared == {"$ref": "#/$defs/tool3-def0", "$defs": {"tool3-def0": {"type": "string"}}}


# --- schemas from the accepted subset, and instances of them ----------------------------

_names = st.text(alphabet="abcxyz_", min_size=1, max_size=6)
# What SmolLM2's vocabulary (the oracle's) can spell.
_texts = st.text(st.characters(max_codepoint=0x2FFF, exclude_categories=["Cs"]), max_size=4)
_leaf = st.one_of(
    st.sampled_from(
        [
            {"type": "string"},
            {"type": "integer"},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {"format": "date"},
            {"type": "string", "format": "uuid"},
            {"type": "string", "format": "time"},
            {"type": "string", "pattern": "^[a-f0-9]{2,4}(-x)?$"},
            {"type": "string", "pattern": "ab|c+"},
            {},
            {"type": "object"},
        ]
    ),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    st.lists(
        st.one_of(_texts, st.integers(-5, 5), st.none()), min_size=1, max_size=3, unique=True
    ).map(lambda vs: {"enum": vs}),
    st.one_of(_texts, st.booleans()).map(lambda v: {"const": v}),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], required: list[str], extra: object) -> Any:
        schema: dict[str, Any] = {
            "type": "object",
            "properties": props,
            "required": [r for r in required if r in props],
        }
        if extra is not None:
            schema["additionalProperties"] = extra
        return schema

    return st.builds(
        build,
        st.dictionaries(_names, children, max_size=3),
        st.lists(_names, max_size=3),
        st.one_of(st.none(), st.booleans(), children),
    )


_schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _objects(children),
        st.builds(
            lambda item, lo: {"type": "array", "items": item, "minItems": lo},
            children,
            st.integers(0, 2),
        ),
        st.lists(children, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
        st.lists(children, min_size=1, max_size=2).map(
            lambda items: {"type": "array", "prefixItems": items, "items": False}
        ),
        st.builds(
            lambda t, other: {"type": [t, "null"], **other},
            st.sampled_from(["string", "object", "array"]),
            st.sampled_from([{}, {"maxLength": 3}, {"properties": {"a": {}}}]),
        ),
    ),
    max_leaves=8,
)


def example(schema: dict[str, Any]) -> Any:
    """A (simple) instance of a schema from ``_schemas``."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return example(schema["anyOf"][-1])
    kind = schema.get("type")
    if isinstance(kind, list):  # a list of types (with null): null
        return None
    if "pattern" in schema:
        return "ab" if schema["pattern"] == "ab|c+" else "0f-x"
    if "format" in schema:
        return {
            "date": "2024-02-29",
            "time": "12:30:00Z",
            "uuid": "123e4567-e89b-12d3-a456-426614174000",
        }[schema["format"]]
    if kind == "object":
        props = schema.get("properties", {})
        return {k: example(props[k]) for k in props if k in schema.get("required", [])}
    if kind == "array":
        if "prefixItems" in schema:
            return [example(s) for s in schema["prefixItems"]]
        return [example(schema["items"])] * schema.get("minItems", 0)
    return {
        "string": "x" * schema.get("minLength", 1),
        "integer": -3,
        "number": 1.5,
        "boolean": True,
        "null": None,
    }.get(str(kind), {})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_schemas)
def test_every_accepted_schema_converts_and_its_instances_are_allowed(schema: Any) -> None:
    assert schema_problem(schema) is None, schema
    grammar = json_grammar(schema)
    assert oracle.parses(grammar.gbnf), grammar.gbnf
    # Constants are written with their characters as they are (no \u escapes).
    instance = json.dumps(example(schema), ensure_ascii=False).replace("\x7f", "\\u007f")
    assert oracle.accepts(grammar, instance), (schema, instance)
