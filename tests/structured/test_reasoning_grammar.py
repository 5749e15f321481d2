"""Grammars for a model that thinks first, judged by llama.cpp's own grammar engine: the
thinking is free, the answer holds, and a call written while thinking starts nothing."""

from __future__ import annotations

import pytest

from structured.grammar import json_grammar, tool_grammar
from structured.reasoning import ThinkingStart
from structured.reasoning_grammar import after_thinking, think_first
from structured.reply import Grammar, Trigger
from tests.structured import oracle
from tests.structured.test_grammar import HERMES_ONE, LLAMA, TOOLS

ANSWER = '{"a": 1}'


def test_no_thinking_leaves_the_grammar_as_it_is() -> None:
    grammar = json_grammar(None)
    assert think_first(grammar, "none") is grammar
    assert think_first(None, "inside") is None


def test_a_grammar_from_the_first_token_lets_the_thinking_come_first() -> None:
    inside = think_first(json_grammar(None), "inside")
    assert inside is not None and oracle.parses(inside.gbnf)
    assert oracle.accepts(inside, f"2 < 3, and </thin k> is no tag.\n</think>\n\n{ANSWER}")
    assert oracle.accepts(inside, f"</think>{ANSWER}")
    assert oracle.accepts(inside, f"<<</think>{ANSWER}")
    assert not oracle.accepts(inside, ANSWER)  # the thinking must end first
    assert not oracle.accepts(inside, "Thinking.</think>\n\nnot JSON")
    assert not oracle.accepts(inside, f"a</think>{ANSWER}</think>")

    may_open = think_first(json_grammar(None), "may_open")
    assert may_open is not None and oracle.parses(may_open.gbnf)
    assert oracle.accepts(may_open, ANSWER)
    assert oracle.accepts(may_open, f"<think>\nHmm.\n</think>\n\n{ANSWER}")
    assert not oracle.accepts(may_open, "<think>Hmm.</think>\n\nnot JSON")
    assert not oracle.accepts(may_open, "Hmm.</think>" + ANSWER)


def test_required_calls_come_after_the_thinking() -> None:
    grammar = think_first(tool_grammar("hermes", TOOLS, parallel=True, lazy=False), "may_open")
    assert grammar is not None
    assert oracle.accepts(grammar, f"<think>I will call it.</think>\n\n{HERMES_ONE}")
    assert oracle.accepts(grammar, HERMES_ONE)
    assert not oracle.accepts(grammar, "<think>I will call it.</think>\n\nNo call.")


THOUGHT_CALL = '<tool_call>\n{"name": "nope"}\n</tool_call>'


@pytest.mark.parametrize("start", ["inside", "may_open"])
def test_a_lazy_grammar_fires_only_after_the_thinking(start: ThinkingStart) -> None:
    grammar = think_first(tool_grammar("hermes", TOOLS, parallel=True, lazy=True), start)
    assert grammar is not None and grammar.triggers
    opening = "<think>\n" if start == "may_open" else ""
    thought = f"{opening}Maybe {THOUGHT_CALL}?\n</think>\n\n"
    # A broken call while thinking is thinking; the call after it is held to the grammar.
    assert oracle.accepts(grammar, thought + "It is sunny.")
    assert oracle.accepts(grammar, thought + "Let me check. " + HERMES_ONE)
    assert not oracle.accepts(grammar, thought + THOUGHT_CALL)
    assert oracle.lazy_sampler_accepts(grammar, thought + "Let me check. " + HERMES_ONE)
    assert oracle.lazy_sampler_accepts(grammar, thought + "It is sunny.")
    text = (thought + "Ok. " + HERMES_ONE).encode()
    starts = {Trigger(p).start(text) for p in grammar.triggers} - {None}
    assert starts == {text.index(b"<tool_call>", text.index(b"</think>"))}


def test_a_reply_that_does_not_think_is_held_as_before() -> None:
    grammar = think_first(tool_grammar("hermes", TOOLS, parallel=True, lazy=True), "may_open")
    assert grammar is not None
    assert oracle.accepts(grammar, "Let me check. " + HERMES_ONE)
    assert not oracle.accepts(grammar, THOUGHT_CALL)
    assert oracle.lazy_sampler_accepts(grammar, "Let me check. " + HERMES_ONE)


@pytest.mark.parametrize("start", ["inside", "may_open"])
def test_a_whole_reply_trigger_lets_the_thinking_come_first(start: ThinkingStart) -> None:
    llama = tool_grammar("llama3", TOOLS, parallel=True, lazy=True)
    grammar = think_first(llama, start)
    assert isinstance(grammar, Grammar)
    opening = "<think>" if start == "may_open" else ""
    thought = f'{opening}Call {{"name": "nope"}} maybe.</think>\n\n'
    assert oracle.accepts(grammar, thought + LLAMA)
    assert not oracle.accepts(grammar, thought + '{"name": "nope", "parameters": {}}')
    assert oracle.lazy_sampler_accepts(grammar, thought + LLAMA)
    bare = llama.triggers[0]
    assert after_thinking(bare, start).endswith(bare[1:])
