"""Grammars on every engine: a JSON schema's grammar holds whatever the seed, and ends the
reply once complete; a complete grammar lets only an end token follow, even against the
model; a lazy grammar leaves the text free until its trigger, then holds; what does not parse
is refused when asked."""

from __future__ import annotations

import json

import pytest

from inference.engines.base import Engine
from structured.reply import Grammar, InvalidRequest
from tests.inference.engines.contract.running import (
    SMALL_SCHEMA,
    decoding,
    finish,
    free_text,
    hex_regex,
    schema_grammar,
    text,
    tokens,
    user,
    valid,
    word,
)

YES_NO = Grammar('root ::= "yes" | "no"')


def test_a_json_schema_grammar_holds_at_temperature_one(engine: Engine) -> None:
    prompt = engine.chat_tokens(user("Describe a student as JSON: name, age, colour."), None)
    grammar = schema_grammar(SMALL_SCHEMA)
    outputs = set()
    for params in [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in range(6)]:
        out = tokens(engine, prompt, 300, decoding(grammar, **params))
        # It ends, with an end token, as soon as the grammar is complete.
        assert engine.is_end(out[-1].id), params
        # strict=False: llama-cpp-python's converter lets control characters into strings
        # (its "char" is [^"\\]), which a random model writes.
        assert valid(json.loads(text(engine, out), strict=False)), params
        outputs.add(text(engine, out))
    assert len(outputs) > 3  # the seeds still choose
    # Served: the reply ends with "stop".
    served, reason = finish(engine, prompt, decoding(grammar, temperature=1.0, seed=0))
    assert valid(json.loads(served, strict=False)) and reason == "stop"
    # The next task with it starts from the grammar's start, not where the last one left it.
    again = tokens(engine, prompt, 300, decoding(grammar, temperature=0))
    assert again == tokens(engine, prompt, 300, decoding(grammar, temperature=0))


def test_a_grammar_holds_and_then_only_an_end_may_follow(engine: Engine) -> None:
    prompt = engine.chat_tokens(user("Is the sky green?"), None)
    for params in [{"temperature": 0}] + [{"temperature": 1.0, "seed": s} for s in range(4)]:
        answer, reason = finish(engine, prompt, decoding(YES_NO, max_tokens=8, **params))
        assert answer in ("yes", "no") and reason == "stop", params


def test_once_complete_only_an_end_token_may_follow(engine: Engine) -> None:
    prompt = engine.text_tokens("hello")
    # Even against the model: the end tokens pushed down, the grammar's letters up.
    ends = [t for t in range(engine.n_vocab) if engine.is_end(t)]
    bias = {t: -50.0 for t in ends} | {word(engine, "a"): 50.0}
    out = tokens(
        engine, prompt, 20, decoding(Grammar('root ::= "ab" "c"?'), temperature=0, logit_bias=bias)
    )
    assert text(engine, out) == b"abc"
    assert engine.is_end(out[-1].id) and len(out) <= 4


def test_a_lazy_grammar_waits_for_its_trigger_then_holds(engine: Engine) -> None:
    prompt, greedy, j = free_text(engine)
    before = text(engine, greedy[:j])
    piece = engine.piece(greedy[j].id)
    # The trigger ends inside token j; its capture group starts inside it too: the grammar
    # is fed the rest of the token from there, then holds.
    trigger = hex_regex(before + piece[:1]) + "(" + hex_regex(piece[1:2]) + ")"
    gbnf = f'root ::= "{piece[1:].decode()}" [0-9] [0-9] [0-9] "."'
    out = tokens(engine, prompt, 40, decoding(Grammar(gbnf, (trigger,)), temperature=0))
    assert [t.id for t in out[: j + 1]] == [t.id for t in greedy[: j + 1]]  # free until then
    after = text(engine, out)[len(before) + len(piece) :]
    assert len(after) == 4 and after[:3].isdigit() and after.endswith(b".")
    assert engine.is_end(out[-1].id)
    # Without a capture group, from the match's start.
    assert piece[:2] not in before + piece[:1]
    trigger = hex_regex(piece[:2])
    gbnf = f'root ::= "{piece.decode()}" "!"'
    out = tokens(engine, prompt, 40, decoding(Grammar(gbnf, (trigger,)), temperature=0))
    assert text(engine, out) == before + piece + b"!"


def test_an_anchored_trigger_must_match_the_whole_text(engine: Engine) -> None:
    prompt, greedy, j = free_text(engine)
    before = text(engine, greedy[:j])
    piece = engine.piece(greedy[j].id)
    gbnf = f'root ::= "{piece.decode()}" "!"'
    # "^...$" is matched against the whole text generated so far, at each token.
    whole = "^" + hex_regex(before) + "(" + hex_regex(piece) + ")$"
    out = tokens(engine, prompt, 40, decoding(Grammar(gbnf, (whole,)), temperature=0))
    assert text(engine, out) == before + piece + b"!"
    # Token j alone is not the whole text: never triggered, the output is free.
    alone = "^" + hex_regex(piece) + "$"
    out = tokens(engine, prompt, len(greedy), decoding(Grammar(gbnf, (alone,)), temperature=0))
    assert [t.id for t in out] == [t.id for t in greedy]


# What each engine says of a grammar that does not parse (llama.cpp's parser, llguidance's).
NOT_PARSING = {
    "llamacpp": [
        ("root ::= foo", "the grammar does not parse: .*Undefined rule identifier 'foo'"),
        ('root ::= "x', "the grammar does not parse: .*unexpected end of input"),
        ('start ::= "x"', "the grammar does not parse: .*does not contain a 'root' symbol"),
        ('root ::= root "x"', "the grammar does not parse: .*left recursion"),
        ('root ::= "a" (', "the grammar does not parse"),
    ],
    "mlx": [
        ("root ::= missing", "grammar"),
        ('root ::= "a" (', "GBNF"),
    ],
}


# Triggers each engine refuses: llama.cpp's are std::regex's (no lookbehind, no named
# groups); MLX's are Python's, which has both.
BAD_TRIGGERS = {"llamacpp": ["(", "(unclosed", "(?<=a)b", "(?P<x>a)"], "mlx": ["(", "(unclosed"]}


def test_grammars_that_do_not_parse_are_refused(engine: Engine, engine_kind: str) -> None:
    prompt = engine.text_tokens("Hi")
    for gbnf, reason in NOT_PARSING[engine_kind]:
        for _ in range(2):  # the second time from the cache
            with pytest.raises(InvalidRequest, match=reason):
                engine.generate(prompt, decoding(Grammar(gbnf)))
    for trigger in BAD_TRIGGERS[engine_kind]:
        with pytest.raises(InvalidRequest, match="trigger"):
            engine.generate(prompt, decoding(Grammar('root ::= "x"', (trigger,))))
    with pytest.raises(InvalidRequest, match="top_logprobs must be between 0 and 20"):
        engine.generate(prompt, decoding(top_logprobs=21))
