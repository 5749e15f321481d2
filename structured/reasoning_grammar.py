"""A reply's grammar when the model thinks first: the thinking is free, the answer constrained.

- A lazy grammar (tool calls with ``auto``, the ``generic`` format's included) keeps its
  grammar and gets triggers that fire only after the thinking ended: a ``<tool_call>`` the
  model writes while it thinks is thinking, and neither starts the grammar nor is read as a call.
- A grammar that holds from the first token (a required call, ``response_format``, the
  ``generic`` format's JSON with a ``response_format``) is given the thinking before its own
  root: any text up to the first ``</think>`` (``inside``), or an optional
  ``<think>...</think>`` block (``may_open``), then whitespace, then the answer the grammar
  asks for.
"""

from __future__ import annotations

import re

from structured.reasoning import THINK_CLOSE, THINK_OPEN, ThinkingStart
from structured.reply import Grammar

# The trigger's text up to the end of the thinking, by where the reply starts (regular
# expressions llama.cpp's std::regex reads as Python's re does).
_THOUGHT_SEARCHED: dict[ThinkingStart, str] = {
    "inside": rf"^[\s\S]*?{re.escape(THINK_CLOSE)}[\s\S]*?",
    # Either a thinking block first, or a reply that does not start with one.
    "may_open": rf"^(?:\s*{re.escape(THINK_OPEN)}[\s\S]*?{re.escape(THINK_CLOSE)}"
    rf"|(?!\s*{re.escape(THINK_OPEN)}))[\s\S]*?",
}
_THOUGHT_WHOLE: dict[ThinkingStart, str] = {
    "inside": rf"^[\s\S]*?{re.escape(THINK_CLOSE)}",
    "may_open": rf"^(?:\s*{re.escape(THINK_OPEN)}[\s\S]*?{re.escape(THINK_CLOSE)})?",
}

_ROOT = re.compile(r"^root ::= ", re.MULTILINE)


def think_first(grammar: Grammar | None, start: ThinkingStart) -> Grammar | None:
    """``grammar`` for a reply that starts as ``start`` says."""
    if grammar is None or start == "none":
        return grammar
    if grammar.triggers:
        return Grammar(grammar.gbnf, tuple(after_thinking(p, start) for p in grammar.triggers))
    return Grammar(thinking_gbnf(grammar.gbnf, start))


def after_thinking(pattern: str, start: ThinkingStart) -> str:
    """A lazy grammar's trigger that fires only after the thinking: where ``pattern`` would
    fire in the text after ``</think>``. The grammar starts where it did (the pattern's first
    group, else its match)."""
    if start == "none":
        return pattern
    if pattern.startswith("^") and pattern.endswith("$"):  # the whole reply: so the answer
        return _THOUGHT_WHOLE[start] + pattern[1:]
    group = pattern if re.compile(pattern).groups else f"({pattern})"
    return _THOUGHT_SEARCHED[start] + f"(?:{group})"


def thinking_gbnf(gbnf: str, start: ThinkingStart) -> str:
    """``gbnf`` (root rule ``root``) after the thinking."""
    if len(_ROOT.findall(gbnf)) != 1:
        raise ValueError("the grammar has no single root rule")
    renamed = _ROOT.sub("reasoning-answer ::= ", gbnf)
    gap = r"[ \t\r\n]{0,8}"
    if start == "inside":
        root = f"root ::= reasoning-0 {gap} reasoning-answer"
    else:
        root = f'root ::= ("<think>" reasoning-0 {gap})? reasoning-answer'
    return f"{root}\n{renamed.rstrip()}\n{_until_close()}\n"


def _until_close() -> str:
    """Rules for any text up to and with the first ``</think>``: a matcher of the tag, state
    ``i`` having read its first ``i`` characters (every other character starts again, ``<``
    at state 1)."""
    rules = []
    for i, char in enumerate(THINK_CLOSE):
        literal = _char(char)
        advance = f'"{literal}"' if i == len(THINK_CLOSE) - 1 else f'"{literal}" reasoning-{i + 1}'
        if i == 0:
            rules.append(f"reasoning-0 ::= [^<] reasoning-0 | {advance}")
        else:
            other = f"[^{_char(char)}<]"
            rules.append(f'reasoning-{i} ::= {advance} | "<" reasoning-1 | {other} reasoning-0')
    return "\n".join(rules)


def _char(char: str) -> str:
    return "\\" + char if char in '"\\]^-[' else char
