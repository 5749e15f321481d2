"""The grammars, judged by llama.cpp's own grammar engine: what they let through and what not."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from events.records import Tool
from structured.formats import TRIGGERS
from structured.grammar import (
    STRING_SCHEMA,
    _schema_gbnf,
    _tools_gbnf,
    gbnf_literal,
    json_grammar,
    tool_grammar,
)
from structured.reply import Grammar
from tests.structured import oracle

WEATHER = Tool(
    name="get_weather",
    description="The weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
)
TIME = Tool(name="get_time", parameters={"type": "object", "properties": {}})
TOOLS = [WEATHER, TIME]
PARIS = '{"city": "Paris"}'
ROME = '{"city": "Rome", "unit": "celsius"}'


def test_json_object_takes_any_object_and_only_valid_json() -> None:
    grammar = json_grammar(None)
    assert oracle.accepts(grammar, '{"a": [1, 2.5e3, true, null, {"b": "\\u00e9\\n"}]}')
    assert oracle.accepts(grammar, "{}")
    assert not oracle.accepts(grammar, "[1]")
    assert not oracle.accepts(grammar, '"text"')
    assert not oracle.accepts(grammar, '{"a": "line\nbreak"}')  # a raw newline
    assert not oracle.accepts(grammar, '{"a": "tab\there"}')
    assert not oracle.accepts(grammar, '{"a": "\\x"}')  # no such escape


def test_a_schema_grammar_holds_the_schema() -> None:
    grammar = json_grammar(WEATHER.parameters)
    assert oracle.accepts(grammar, PARIS)
    assert oracle.accepts(grammar, ROME)
    assert not oracle.accepts(grammar, '{"unit": "celsius"}')  # city is required
    assert not oracle.accepts(grammar, '{"city": "Rome", "unit": "kelvin"}')
    assert not oracle.accepts(grammar, '{"city": 3}')
    assert not oracle.accepts(grammar, '{"city": "Rome", "other": 1}')


GRAMMARS: list[Grammar] = [
    json_grammar(None),
    json_grammar(WEATHER.parameters),
    json_grammar({"type": "array", "items": {"type": "string", "maxLength": 8}}),
    json_grammar({"type": "object", "additionalProperties": {"type": "string"}}),
    *(tool_grammar(f, TOOLS, parallel=True, lazy=False) for f in ("hermes", "llama3", "mistral")),
    tool_grammar("generic", TOOLS, parallel=True, lazy=False, response=STRING_SCHEMA),
]


@pytest.mark.parametrize("grammar", GRAMMARS, ids=range(len(GRAMMARS)))
def test_no_grammar_lets_a_raw_control_character_into_a_string(grammar: Grammar) -> None:
    # The Python converter's own char rule, [^"\\], would let these through.
    assert '[^"\\\\] |' not in grammar.gbnf
    assert 'char ::= [^"\\\\\\x7F\\x00-\\x1F]' in grammar.gbnf
    checked = 0
    city = '"get_weather", "arguments": {"city": "x'
    prefixes = [
        '{"a": "x',
        '["x',
        '{"x',
        '{"city": "x',
        f'<tool_call>\n{{"name": {city}',
        '{"name": "get_weather", "parameters": {"city": "x',
        f'[TOOL_CALLS][{{"name": {city}',
        f'{{"tool_calls": [{{"name": {city}',
        '{"response": "x',
    ]
    for prefix in prefixes:
        if oracle.accepts_prefix(grammar, prefix):
            checked += 1
            assert oracle.accepts_prefix(grammar, prefix + "\\n")
            for raw in ("\n", "\t", "\r", "\x01", "\x7f"):
                assert not oracle.accepts_prefix(grammar, prefix + raw), (prefix, raw)
    assert checked


def test_literals_with_backslashes_and_unicode_are_written_as_json() -> None:
    grammar = json_grammar({"enum": ["a\\b", 'say "hi"', "tab\t", "café"]})
    for value in ("a\\b", 'say "hi"', "tab\t", "café"):
        assert oracle.accepts(grammar, json.dumps(value, ensure_ascii=False)), value
    assert not oracle.accepts(grammar, '"a\\b"')  # that is a\x08, a backspace
    assert gbnf_literal('a"b\\c\n') == '"a\\"b\\\\c\\n"'


HERMES_ONE = f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'
HERMES_TWO = HERMES_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA = f'{{"name": "get_weather", "parameters": {PARIS}}}'
MISTRAL_ONE = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]'
MISTRAL_TWO = (
    f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ROME}}}, {{"name":'
    ' "get_time", "arguments": {}}]'
)
GENERIC_ONE = f'{{"tool_calls": [{{"name": "get_weather", "arguments": {PARIS}}}]}}'
GENERIC_TWO = (
    f'{{"tool_calls": [{{"name": "get_weather", "arguments": {PARIS}}}, {{"name":'
    ' "get_time", "arguments": {}}]}'
)

FORMS: dict[str, tuple[str, str, list[str]]] = {
    # format: one call, two calls, not calls
    "hermes": (
        HERMES_ONE,
        HERMES_TWO,
        [
            '<tool_call>\n{"name": "get_wether", "arguments": {"city": "P"}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"town": "P"}}\n</tool_call>',
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}',  # not closed
            '<tool_call>\n{"arguments": {"city": "P"}, "name": "get_weather"}\n</tool_call>',
            '<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>',
        ],
    ),
    "llama3": (
        LLAMA,
        LLAMA + '; {"name": "get_time", "parameters": {}}',
        [
            '{"name": "get_weather", "arguments": {"city": "P"}}',
            '{"name": "get_weather", "parameters": {}}',
        ],
    ),
    "mistral": (
        MISTRAL_ONE,
        MISTRAL_TWO,
        [
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "P"}, "id": "abcdefghi"}]',
            '[{"name": "get_weather", "arguments": {"city": "P"}}]',
            "[TOOL_CALLS][]",
        ],
    ),
    "generic": (
        GENERIC_ONE,
        GENERIC_TWO,
        [
            '{"tool_calls": []}',
            '{"tool_calls": [{"name": "nope", "arguments": {}}]}',
            '{"response": "hello"}',
        ],
    ),
}


@pytest.mark.parametrize("fmt", list(FORMS))
def test_required_calls_are_the_whole_reply(fmt: Any) -> None:
    one, two, wrong = FORMS[fmt]
    several = tool_grammar(fmt, TOOLS, parallel=True, lazy=False)
    single = tool_grammar(fmt, TOOLS, parallel=False, lazy=False)
    assert oracle.accepts(several, one)
    assert oracle.accepts(single, one)
    assert oracle.accepts(several, two) is (fmt != "llama3")  # Llama: one call per reply
    assert not oracle.accepts(single, two)
    assert not oracle.accepts(several, "Sure! " + one)
    for text in wrong:
        assert not oracle.accepts(several, text), text


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_a_lazy_grammar_lets_text_through_and_holds_from_the_marker(fmt: Any) -> None:
    one, _, wrong = FORMS[fmt]
    grammar = tool_grammar(fmt, TOOLS, parallel=True, lazy=True)
    assert grammar.triggers == TRIGGERS[fmt]
    assert oracle.accepts(grammar, "The weather is fine, no need to look it up.")
    assert oracle.accepts(grammar, "{not a call at all}")
    assert oracle.accepts(grammar, one)
    for text in wrong:
        if oracle.trigger_start(grammar.triggers, text) is not None:
            assert not oracle.accepts(grammar, text), text
    assert oracle.lazy_sampler_accepts(grammar, one)  # as llama.cpp's own lazy sampler
    assert oracle.lazy_sampler_accepts(grammar, "Just text.")


def test_text_may_come_before_a_marked_call() -> None:
    hermes = tool_grammar("hermes", TOOLS, parallel=True, lazy=True)
    assert oracle.accepts(hermes, "Let me check.\n" + HERMES_ONE)
    assert oracle.lazy_sampler_accepts(hermes, "Let me check.\n" + HERMES_ONE)
    assert not oracle.accepts(hermes, "Let me check.\n" + HERMES_ONE + " Done.")
    mistral = tool_grammar("mistral", TOOLS, parallel=True, lazy=True)
    assert oracle.accepts(mistral, "Checking. " + MISTRAL_ONE)
    llama = tool_grammar("llama3", TOOLS, parallel=True, lazy=True)
    assert oracle.accepts(llama, "I will call it: <|python_tag|>" + LLAMA)
    assert oracle.lazy_sampler_accepts(llama, "I will call it: <|python_tag|>" + LLAMA)
    assert oracle.accepts(llama, '\n  {"type": "function", "name": "get_time", "parameters": {}}')
    # A bare call counts only as the whole reply: elsewhere it is text.
    assert oracle.accepts(llama, 'Text, then {"name": "nothing"')


def test_a_named_function_is_the_only_call_allowed() -> None:
    grammar = tool_grammar("hermes", [WEATHER], parallel=True, lazy=False)
    assert oracle.accepts(grammar, HERMES_ONE)
    assert not oracle.accepts(grammar, HERMES_TWO)


def test_generic_auto_calls_or_answers() -> None:
    grammar = tool_grammar("generic", TOOLS, parallel=True, lazy=False, response=STRING_SCHEMA)
    assert grammar.triggers == ()
    assert oracle.accepts(grammar, GENERIC_TWO)
    assert oracle.accepts(grammar, '{"response": "It is sunny.\\nEnjoy!"}')
    assert not oracle.accepts(grammar, '{"response": 3}')
    assert not oracle.accepts(grammar, "It is sunny.")
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    }
    shaped = tool_grammar("generic", TOOLS, parallel=True, lazy=False, response=schema)
    assert oracle.accepts(shaped, '{"response": {"answer": 42}}')
    assert not oracle.accepts(shaped, '{"response": "42"}')


def test_native_auto_with_a_response_format_is_calls_or_the_json() -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    }
    grammar = tool_grammar("hermes", TOOLS, parallel=True, lazy=False, response=schema)
    assert oracle.accepts(grammar, HERMES_ONE)
    assert oracle.accepts(grammar, '{"answer": 42}')
    assert not oracle.accepts(grammar, "42")


def test_rule_names_of_different_tools_do_not_collide() -> None:
    # The same property names and definition names, with different types.
    one = Tool(
        name="one",
        parameters={
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"v": {"type": "integer"}},
                    "required": ["v"],
                }
            },
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
        },
    )
    two = Tool(
        name="two",
        parameters={
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {"v": {"type": "string"}},
                    "required": ["v"],
                }
            },
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
        },
    )
    grammar = tool_grammar("generic", [one, two], parallel=True, lazy=False)

    def call(name: str, value: str) -> str:
        return (
            f'{{"tool_calls": [{{"name": "{name}", "arguments": {{"item": {{"v": {value}}}}}}}]}}'
        )

    assert oracle.accepts(grammar, call("one", "1"))
    assert oracle.accepts(grammar, call("two", '"1"'))
    assert not oracle.accepts(grammar, call("one", '"1"'))
    assert not oracle.accepts(grammar, call("two", "1"))


def test_grammars_are_built_once() -> None:
    tool_grammar("mistral", TOOLS, parallel=False, lazy=True)
    hits = _tools_gbnf.cache_info().hits
    again = tool_grammar("mistral", TOOLS, parallel=False, lazy=False)
    assert _tools_gbnf.cache_info().hits == hits + 1  # laziness is no part of the grammar
    assert again.triggers == ()
    json_grammar(WEATHER.parameters)
    hits = _schema_gbnf.cache_info().hits
    json_grammar(json.loads(json.dumps(WEATHER.parameters)))
    assert _schema_gbnf.cache_info().hits == hits + 1


def test_building_a_grammar_is_quick() -> None:
    properties: dict[str, Any] = {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[^@]+@[^@]+\\.[a-z]{2,}$"},
        "born": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        },
        "active": {"type": "boolean"},
    }

    def schema(p: dict[str, Any]) -> Grammar:
        return json_grammar({"type": "object", "properties": p, "required": list(p)[:5]})

    def tools(p: dict[str, Any]) -> Grammar:
        tool = Tool(name="f", parameters={"type": "object", "properties": p})
        return tool_grammar("hermes", [tool, WEATHER], parallel=True, lazy=True)

    builders: list[tuple[str, Callable[[dict[str, Any]], Grammar]]] = [
        ("schema", schema),
        ("tools", tools),
    ]
    for label, build in builders:
        started = time.perf_counter()
        grammar = build(properties)
        elapsed = time.perf_counter() - started
        started = time.perf_counter()
        build(properties)
        cached = time.perf_counter() - started
        print(
            f"\n{label} grammar, 10 properties: built in {elapsed * 1000:.2f} ms,"
            f" {cached * 1e6:.0f} µs from the cache"
        )
        assert oracle.parses(grammar.gbnf)
        properties = {f"{k}2": v for k, v in properties.items()}  # a new key: not cached
