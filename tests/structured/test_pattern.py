"""JSON schema patterns, as the grammar holds them: matched against the whole string, and never
letting the model write invalid JSON."""

from __future__ import annotations

import json

import pytest

from structured.grammar import json_grammar
from structured.pattern import PatternError, converter_pattern
from tests.structured import oracle

CASES: list[tuple[str, list[str], list[str]]] = [
    ("^\\d{3}-\\d{4}$", ["555-1234"], ["5551234", "555-12345", "a55-1234"]),
    ("^[A-Z][a-z]+$", ["Paris"], ["paris", "P"]),
    ("^(?:ab|c)+$", ["ab", "cabc"], ["", "a", "abd"]),
    ("^a\\.b$", ["a.b"], ["axb"]),
    ("^\\w+@\\w+\\.com$", ["ada@example.com"], ["ada@example.org", "@x.com"]),
    ("^x{2,3}$", ["xx", "xxx"], ["x", "xxxx"]),
    ("^x{2,}$", ["xx", "xxxxx"], ["x"]),
    ("^[^,]+$", ["a b;c"], ["a,b", ""]),
    ("^.{0,3}$", ["", "abc", "é日本"], ["abcd"]),
    ("^\\$[0-9]+(\\.[0-9]{2})?$", ["$5", "$5.25"], ["$5.2", "5"]),
    ("cat", ["cat", "concatenate", "a cat!"], ["ca t", "dog"]),  # unanchored: anywhere
    ("^cat", ["cat", "catalogue"], ["a cat"]),
    ("cat$", ["cat", "bobcat"], ["cats"]),
    ("^[\\s\\S]*$", ["anything, even this"], []),
    ("^\\S+$", ["x"], ["a b", ""]),
    ("^[a-c-]+$", ["a-b"], ["d"]),
    ("^\\u00e9t\\xe9$", ["été"], ["ete"]),
    ("^(a|)b$", ["ab", "b"], ["aab"]),
    ("^a*?b+?$", ["aab", "b"], ["a"]),  # lazy quantifiers match the same strings
    ("^[]a]+$", ["]a"], ["b"]),  # a ']' first in a class is the character
]


@pytest.mark.parametrize(("pattern", "good", "bad"), CASES, ids=[c[0] for c in CASES])
def test_a_pattern_holds_for_the_whole_string(
    pattern: str, good: list[str], bad: list[str]
) -> None:
    grammar = json_grammar({"type": "string", "pattern": pattern})
    for text in good:
        assert oracle.accepts(grammar, json.dumps(text, ensure_ascii=False)), (pattern, text)
    for text in bad:
        assert not oracle.accepts(grammar, json.dumps(text, ensure_ascii=False)), (pattern, text)


@pytest.mark.parametrize("pattern", ["^.*$", "^[^a]*$", "^\\D*$", "^\\W*$", "^[\\x00-\\x7F]*$"])
def test_no_class_lets_a_quote_a_backslash_or_a_control_character_in(pattern: str) -> None:
    grammar = json_grammar({"type": "string", "pattern": pattern})
    assert oracle.accepts(grammar, '"+-!"')
    for raw in ('"+"+"', '"+\\+"', '"+\n+"', '"+\t+"', '"+\x7f+"'):
        assert not oracle.accepts(grammar, raw), (pattern, raw)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(?=a)", "lookarounds"),
        ("(?P<n>a)", "lookarounds and named groups"),
        ("(a)\\1", "backreferences"),
        ("\\bx", "word boundaries"),
        ("\\p{L}", "Unicode properties"),
        ("a{1001}", "above 1000"),
        ("a**", "a quantifier follows another"),
        ("a{x}", "no quantifier"),
        ("*a", "repeats nothing"),
        ("(a", "unclosed '('"),
        ("a)", "unbalanced ')'"),
        ("[a", "unclosed '['"),
        ("[z-a]", "backwards"),
        ("a\\", "lone backslash"),
        ("\\q", "the escape '\\q'"),
        ('a"', "JSON must escape"),
        ("\\\\", "JSON must escape"),
        ("a\\n", "JSON must escape"),
        ("[\\n\\t]", "only characters JSON must escape"),
        ("^a|^b", "only supported at its start"),
        ("(a|)*", "can match nothing"),
    ],
)
def test_what_patterns_cannot_do_is_said(pattern: str, why: str) -> None:
    with pytest.raises(PatternError, match=None) as raised:
        converter_pattern(pattern)
    assert why in str(raised.value)


def test_classes_are_written_as_hexadecimal_ranges() -> None:
    assert converter_pattern("^[a-c]x\\d?$") == "^([\\x61-\\x63]x[\\x30-\\x39]?)$"
