"""The contract between the constrained-decoding library and the engines that use it: the
grammar an engine constrains its sampling to (``Grammar``, its lazy ``Trigger``s), the reply
parser the shared generation code feeds the generated text to (``ReplyParser``, what it makes of
it: ``Parsed``), and the error for a task that cannot be served as asked (``InvalidRequest``).

Written here, under the engines, so that ``structured/`` imports nothing from the runner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from events.records import ToolCallDelta


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar (llama.cpp's dialect, root rule ``root``) the output must match.

    With ``triggers`` the grammar is lazy, as llama.cpp's ``grammar_lazy_patterns``: the model
    writes freely until the text generated so far matches one of these regular expressions
    (searched for anywhere; a pattern written ``^...$`` must match the whole text). From then
    on the grammar holds, applied to the text from the start of the pattern's first capture
    group that matched something (the whole match if none did), and once it is complete the
    only token allowed is an end of generation."""

    gbnf: str
    triggers: tuple[str, ...] = ()


class Trigger:
    """A lazy grammar's trigger, matched as llama.cpp does
    (``llama_grammar_trigger_pattern::find``), on the bytes of the text generated so far: a
    pattern written ``^...$`` must match all of it (``$`` is the end of the text, not before a
    last newline as in Python), any other is searched for; the grammar starts at the first
    capture group that matched something, else at the match. Raises ``re.error`` for a pattern
    that is no regular expression."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._whole = pattern.startswith("^") and pattern.endswith("$")
        self._regex = re.compile(pattern.encode())

    def start(self, text: bytes) -> int | None:
        """Where in ``text`` the grammar starts, or None while the pattern does not match."""
        match = self._regex.fullmatch(text) if self._whole else self._regex.search(text)
        if match is None:
            return None
        for group in range(1, self._regex.groups + 1):
            if match.end(group) > match.start(group):
                return match.start(group)
        return match.start()


@dataclass(frozen=True)
class Parsed:
    """What a reply parser made of some generated text: text for the reply's content, pieces
    of tool calls, and a thinking model's thinking."""

    text: str = ""
    calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""
    # The reply is over, though the model would go on: it repeated a call it made
    # (``structured/repeats.py``). Nothing more is generated; it ends with ``tool_calls``.
    ended: bool = False
    # What was fed was (or opened, or closed) a thinking model's thinking: for the usage's
    # count of reasoning tokens.
    thinking: bool = False
    # After what was fed, the reply is inside its thinking (opened, not yet closed): where a
    # thinking budget can end it.
    thinking_open: bool = False


class ReplyParser(Protocol):
    """Splits the generated text into the reply's content and its tool calls (the format is
    the model's, see ``structured/``)."""

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed:
        """What is left once generation ended."""
        ...

    @property
    def called(self) -> bool:
        """Whether the reply holds a tool call."""
        ...

    @property
    def markers(self) -> frozenset[str]:
        """Special tokens' texts the parser must be fed (a tool call's marker), though the
        reply shows no special token."""
        ...


class PlainReply:
    """A reply that is all content."""

    called = False
    markers: frozenset[str] = frozenset()

    def feed(self, text: str) -> Parsed:
        return Parsed(text)

    def finish(self) -> Parsed:
        return Parsed()


class InvalidRequest(ValueError):
    """The task cannot be served as asked; the message says why, for TaskFailed."""
