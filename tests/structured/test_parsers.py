"""Reading replies back, as they stream: recorded-style outputs of each format, well-formed and
not, fed whole, a character at a time and cut anywhere; a call repeated ends the reply."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.records import ToolCallDelta
from structured.formats import ToolFormatName, call_id
from structured.parsers import ParserSpec, ToolReplyParser, make_parser
from structured.repeats import first_repeat
from structured.reply import Parsed

TASK = "task-7"
NAMES = frozenset({"get_weather", "get_time"})


@dataclass
class Read:
    content: str
    calls: list[tuple[str, str]]  # (name, arguments)
    called: bool
    deltas: list[ToolCallDelta]
    ended: bool  # at a repeated call


def read(fmt: ToolFormatName, pieces: list[str], bare: bool = True) -> Read:
    parser = make_parser(ParserSpec(fmt, TASK, NAMES, bare))
    results: list[Parsed] = [parser.feed(p) for p in pieces]
    results.append(parser.finish())
    deltas = [d for r in results for d in r.calls]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in calls:
            # The first delta of a call has its index (the next one), id and name.
            assert d.index == len(calls)
            assert d.id == call_id(fmt, TASK, d.index)
            assert d.name is not None
            calls[d.index] = [d.name, ""]
        else:
            assert d.id is None and d.name is None
        calls[d.index][1] += d.arguments
    # Once ended, every parse says so.
    ended = [r.ended for r in results]
    assert ended == sorted(ended)
    return Read(
        "".join(r.text for r in results),
        [(n, a) for n, a in calls.values()],
        parser.called,
        deltas,
        ended[-1],
    )


W = ("get_weather", '{"city": "Paris"}')
T = ("get_time", "{}")

CASES: list[tuple[ToolFormatName, str, str, list[tuple[str, str]]]] = [
    # hermes
    ("hermes", "Hello there!", "Hello there!", []),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [W],
    ),
    (
        "hermes",
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city":'
        ' "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
        "\n</tool_call>",
        "Let me check.",
        [W, T],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and'
        ' then <tool_call>{"name": "get_time"}</tool_call> done.',
        "and then done.",
        [W, T],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
        "",
        [W],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "id": 4, "arguments": {"city": "Paris"},'
        ' "extra": [1, {"a": "}"}]}\n</tool_call>',
        "",
        [W],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
        "</tool_call>",
        "",
        [W],
    ),
    ("hermes", "I can't <tool_call> that.", "I can't <tool_call> that.", []),
    (
        "hermes",
        '<tool_call>\n{"name": broken}\n</tool_call>Sorry.',
        '<tool_call>\n{"name": broken}\n</tool_call>Sorry.',
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"] oops',
        "] oops",
        [("get_weather", '{"city": "Paris"')],
    ),
    ("hermes", "Use <tool_cal", "Use <tool_cal", []),
    (
        "hermes",
        '<tool_call>\n{\n  "name" :\n "get_time" ,\n "arguments" : { }\n}\n</tool_call>',
        "",
        [("get_time", "{ }")],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        [],
    ),
    # llama3
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W]),
    (
        "llama3",
        '\n {"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [W],
    ),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W]),
    (
        "llama3",
        'Sure: <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "Sure:",
        [W],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time",'
        ' "parameters": {}}',
        "",
        [W, T],
    ),
    ("llama3", '{"name": "Ada", "age": 3}', '{"name": "Ada", "age": 3}', []),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3", 'The call is {"name": "get_time"}', 'The call is {"name": "get_time"}', []),
    ("llama3", '{"parameters": {"city": "Paris"}, "name": "get_weather"}', "", [W]),
    ("llama3", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3", '{"name": "get_weather", "parameters": {"city"', "", [("get_weather", '{"city"')]),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [W]),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id":'
        ' "a1b2c3d4e"}, {"name": "get_time", "arguments": {}}]',
        "",
        [W, T],
    ),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [W]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Checking.", [T]),
    ("mistral", '[TOOL_CALLS]{"name": "get_time", "arguments": {}}', "", [T]),
    ("mistral", "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ("mistral", '[{"name": "Ada"}]', '[{"name": "Ada"}]', []),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, oops', "oops", [T]),
    # generic
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
    (
        "generic",
        '{"response": "Line\\nTab\\t\\"q\\" \\\\ \\/ \\u00e9\\u20ac \\ud83d\\ude00"}',
        'Line\nTab\t"q" \\ / é€ 😀',
        [],
    ),
    ("generic", '{"response": "lone \\ud83d here \\ude00"}', "lone \ufffd here \ufffd", []),
    ("generic", '{"response": "bad \\u12zz"}', "bad \ufffd12zz", []),
    ("generic", '  {\n "response" : "x" }\n', "x", []),
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        "",
        [W],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},'
        ' {"arguments": {}, "name": "get_time"}]}',
        "",
        [W, T],
    ),
    ("generic", '{"response": {"answer": 42}}', '{"answer": 42}', []),
    ("generic", "Just text, no JSON.", "Just text, no JSON.", []),
    ("generic", '{"answer": 42}', '{"answer": 42}', []),
    ("generic", '{"thought": "hmm", "response": "ok"}', "ok", []),
    ("generic", '{"response": "cut off', "cut off", []),
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},'
        ' {"name": "get_weather", "arguments": {"city": "Rome"}}]}',
        "",
        [W, ("get_weather", '{"city": "Rome"}')],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa',
        "",
        [("get_weather", '{"city": "Pa')],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "unknown_tool", "arguments": {}}]}',
        "",
        [("unknown_tool", "{}")],
    ),
]


# A call identical to an earlier one (name and arguments as JSON values) ends the reply: it is
# dropped, and what follows it is not read.
REPEATED: list[tuple[ToolFormatName, str, str, list[tuple[str, str]]]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
        "Then more text.",
        "",
        [W],
    ),
    (
        "hermes",
        'Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call> <tool_call>{"name": "get_time", "arguments": {}}</tool_call> and'
        ' <tool_call>{"arguments": "{\\"city\\": \\"Paris\\"}", "name": "get_weather"}'
        "</tool_call> again",
        "Let me see. and",
        [W, T],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},'
        ' {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather",'
        ' "arguments": {"city": "Par',
        "",
        [W],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_time"}]}',
        "",
        [T],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather",'
        ' "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        "",
        [T, W],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather",'
        ' "parameters": {"city": "Paris"}}',
        "",
        [W],
    ),
]
ENDED = {text for _, text, _, _ in REPEATED}
CASES += REPEATED


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_recorded_replies(
    fmt: ToolFormatName, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for pieces in (
        [text],
        list(text),
        [text[i : i + 3] for i in range(0, len(text), 3)],
        ["", text, ""],
    ):
        got = read(fmt, pieces)
        assert (got.content, got.calls) == (content, calls), pieces[:3]
        assert got.called is bool(calls)
        assert got.ended is (text in ENDED)


def test_a_call_streams_as_it_comes() -> None:
    parser = make_parser(ParserSpec("hermes", TASK, NAMES))
    assert parser.feed("Let me look.") == Parsed("Let me look.")
    assert parser.feed("\n<tool") == Parsed()  # could be the marker: held back
    assert parser.feed("_call>\n{") == Parsed()
    assert parser.feed('"name": "get_wea') == Parsed()  # the name is not complete
    first = parser.feed('ther", "arguments": {"ci')
    assert first.calls == (
        ToolCallDelta(index=0, id=call_id("hermes", TASK, 0), name="get_weather", arguments='{"ci'),
    )
    assert parser.called
    assert parser.feed('ty": "Paris"}').calls == (
        ToolCallDelta(index=0, arguments='ty": "Paris"}'),
    )
    assert parser.feed("}\n</tool_call>") == Parsed()
    assert parser.finish() == Parsed()


def test_arguments_before_the_name_wait_for_it() -> None:
    parser = make_parser(ParserSpec("hermes", TASK, NAMES))
    assert parser.feed('<tool_call>{"arguments": {"city": "Paris"}, ') == Parsed()
    out = parser.feed('"name": "get_weather"}')
    assert out.calls == (
        ToolCallDelta(
            index=0,
            id=call_id("hermes", TASK, 0),
            name="get_weather",
            arguments='{"city": "Paris"}',
        ),
    )


def test_generic_response_streams_character_by_character() -> None:
    parser = make_parser(ParserSpec("generic", TASK, NAMES))
    assert parser.feed('{"response": "He') == Parsed("He")
    assert parser.feed("llo \\") == Parsed("llo ")  # an escape, cut
    assert parser.feed("n\\u00") == Parsed("\n")
    assert parser.feed("e9 \\ud83d") == Parsed("é ")  # the high surrogate waits for its pair
    assert parser.feed("\\ude00") == Parsed("😀")
    assert parser.feed('"}') == Parsed()
    assert parser.finish() == Parsed()


def test_the_ids_are_the_same_on_a_replay() -> None:
    assert call_id("hermes", "t", 0) == call_id("hermes", "t", 0) != call_id("hermes", "t", 1)
    assert call_id("hermes", "t", 0).startswith("call_") and len(call_id("hermes", "t", 0)) == 29
    mistral = call_id("mistral", "t", 3)
    assert len(mistral) == 9 and mistral.isalnum()


def test_a_bare_call_needs_an_offered_name_and_the_flag() -> None:
    text = '[{"name": "get_time", "arguments": {}}]'
    assert read("mistral", [text]).calls == [T]
    assert read("mistral", [text], bare=False).content == text
    text = '{"name": "get_time", "parameters": {}}'
    assert read("llama3", [text], bare=False).content == text


def test_after_finish_nothing_more_is_read() -> None:
    parser = make_parser(ParserSpec("generic", TASK, NAMES))
    assert parser.feed('{"response": "a"}') == Parsed("a")
    assert parser.finish() == Parsed()
    assert parser.feed("more") == Parsed()
    assert parser.finish() == Parsed()


def test_a_parser_is_a_reply_parser() -> None:
    from structured.reply import ReplyParser

    parser: ReplyParser = ToolReplyParser(ParserSpec("hermes", TASK, NAMES))
    assert not parser.called


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=12))
def test_any_cut_gives_the_same_reply(
    case: tuple[ToolFormatName, str, str, list[tuple[str, str]]], cuts: list[int]
) -> None:
    fmt, text, content, calls = case
    at = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]
    got = read(fmt, pieces)
    assert (got.content, got.calls, got.ended) == (content, calls, text in ENDED)


def test_a_call_that_may_repeat_one_is_held_until_it_is_whole() -> None:
    parser = make_parser(ParserSpec("hermes", TASK, NAMES))
    paris = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert parser.feed(paris).calls[0].name == "get_weather"
    # The name of a call made: nothing goes out until the arguments say whether it repeats it.
    assert parser.feed('<tool_call>{"name": "get_weather", "arguments": {"ci') == Parsed()
    assert parser.feed('ty": "Rome"}') == Parsed()
    assert parser.feed("}") == Parsed(
        calls=(
            ToolCallDelta(
                index=1,
                id=call_id("hermes", TASK, 1),
                name="get_weather",
                arguments='{"city": "Rome"}',
            ),
        )
    )
    # A new name streams at once.
    assert parser.feed('</tool_call><tool_call>{"name": "get_time", "arg').calls[0].index == 2
    rest = parser.feed('uments": {}}</tool_call>')
    assert rest.calls == (ToolCallDelta(index=2, arguments="{}"),)
    assert parser.feed(paris[:-12]) == Parsed(ended=True)  # the first one again: the end
    assert parser.feed("</tool_call>More.") == Parsed(ended=True)
    assert parser.finish() == Parsed(ended=True)
    assert parser.called


def test_a_held_call_cut_off_keeps_what_was_written() -> None:
    got = read(
        "hermes",
        [
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "get_time", "arguments": {"zone": "U',
        ],
    )
    assert got.calls == [T, ("get_time", '{"zone": "U')] and not got.ended


def test_a_broken_held_call_keeps_its_place_before_later_text() -> None:
    got = read(
        "hermes",
        ['<tool_call>{"name": "get_time"}</tool_call>', '<tool_call>{"name": "get_time", x} ok'],
    )
    assert got.calls == [T, ("get_time", "")] and got.content == "x} ok" and not got.ended


_call = st.builds(
    lambda name, args: json.dumps({"name": name, "arguments": args}),
    st.sampled_from(sorted(NAMES)),
    st.dictionaries(
        st.text(max_size=5),
        st.one_of(st.text(max_size=8), st.integers(), st.lists(st.booleans(), max_size=2)),
        max_size=3,
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.lists(_call, min_size=1, max_size=3), st.data())
def test_hermes_calls_with_any_text_and_any_cut(
    text: str, calls: list[str], data: st.DataObject
) -> None:
    reply = text + "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls)
    cuts = data.draw(st.lists(st.integers(0, len(reply)), max_size=10))
    at = sorted(set(cuts))
    pieces = [reply[a:b] for a, b in zip([0, *at], [*at, len(reply)], strict=True)]
    got = read("hermes", pieces)
    expected = [(json.loads(c)["name"], json.dumps(json.loads(c)["arguments"])) for c in calls]
    if "<tool_call>" in text or "<" in text[-12:]:
        return  # the text itself may hold (the start of) a marker
    repeat = first_repeat(expected)
    assert got.calls == expected[:repeat]
    assert got.ended is (repeat is not None)
    assert got.content == text.rstrip(" \t\r\n")
