"""Reading a reply's tool calls as it is generated, in the model's format.

A parser is fed the generated text in pieces of any size and says at once what it can: content
(text outside calls) and ``ToolCallDelta``s. The first delta of call ``i`` has ``index=i``, its
id and its name, as soon as the name is complete; later ones carry the arguments' JSON text as
the model writes it, so that their concatenation is the arguments' JSON text (a string value
given as arguments, ``"{\\"a\\": 1}"``, is unescaped: its content is the JSON). Text that may
be the start of a marker (``<tool_c``...) is held back until it is known not to be, and so is
whitespace, which is dropped before a call and at the end of a reply with calls.

Malformed output is handled so that nothing is lost and nothing is invented:

- Text before, between and after calls is content.
- A marker followed by something that is not a call (no JSON object, JSON broken before the
  function's name is known, an object without a name) is content, marker and all, and reading
  goes on after it.
- A call whose JSON breaks after its name (or is cut off by the end of the reply) keeps what was
  streamed; the text from where it broke is content again.
- Arguments written before the name are held until the name comes. Keys other than the name and
  the arguments (``"arguments"`` or ``"parameters"``) are ignored, and so is a second value of
  either. A call without arguments gets ``{}``.
- A call identical to one the reply already made (same name, same arguments as JSON values:
  ``repeats.py``) ends the reply: it is dropped and nothing after it is read, and the parse says
  so (``Parsed.ended``), for generation to stop. A call whose name an earlier whole call has is
  held back until it is whole, so that none of a dropped call goes out.
- A bare JSON call with no marker (Llama's form; Mistral's array when the marker token is not
  shown) counts only at the start of the reply and only if its name is one of the tools offered;
  anything else is content.
- ``generic``: a reply that is not the JSON object is content as it is; ``{"response": "..."}``
  gives the string's characters as content (escapes decoded across pieces, ``\\u`` escapes
  and surrogate pairs included); a non-string response (a ``response_format`` schema's JSON) is
  content as its JSON text; ``{"tool_calls": [...]}`` gives the calls.

Each parser reads one character at a time, so that where the pieces are cut does not change
what comes out.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Literal

from events.records import ToolCallDelta
from structured.formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_CALLS,
    PYTHON_TAG,
    ToolFormatName,
    call_id,
)
from structured.repeats import CallKey, call_key
from structured.reply import Parsed
from structured.text_reader import (
    WHITESPACE,
    Broken,
    Reading,
    TextReader,
)

_ARGUMENT_KEYS = ("arguments", "parameters")
Outcome = Literal["call", "cut", "none"]


class _Repeated(Exception):
    """The call just read is identical to an earlier one: the reply ends before it."""


# The format's markers, which some models' vocabularies hold as special tokens (Mistral's
# [TOOL_CALLS], Llama's <|python_tag|>): the parser must see them though a reply shows none.
MARKERS: dict[ToolFormatName, frozenset[str]] = {
    "hermes": frozenset({HERMES_OPEN, HERMES_CLOSE}),
    "mistral": frozenset({MISTRAL_CALLS}),
    "llama3": frozenset({PYTHON_TAG}),
    "generic": frozenset(),
}


@dataclass(frozen=True)
class ParserSpec:
    """What a task's parser needs: the format, the task (for the calls' ids) and the
    functions offered (a bare call must name one)."""

    format: ToolFormatName
    task_id: str
    names: frozenset[str] = field(default_factory=frozenset)
    # Whether a reply may start with a bare call (no marker): not when a response_format's
    # JSON could be taken for one.
    bare: bool = True


def make_parser(spec: ParserSpec) -> ToolReplyParser:
    return ToolReplyParser(spec)


class ToolReplyParser(TextReader):
    """A ``ReplyParser`` for one reply in ``spec.format``."""

    def __init__(self, spec: ParserSpec) -> None:
        self._spec = spec
        self._text: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        super().__init__()
        self._calls = 0
        self._wrapped = False  # generic: the reply is the JSON object
        self._gap = ""  # the whitespace before the marker just read
        self._pending = ""  # whitespace to write before more content, if more comes
        self._said = False  # whether there is content yet
        self._made: set[CallKey] = set()  # the calls read whole
        self._made_names: set[str] = set()
        self._reading: tuple[str, list[str]] | None = None  # the call being read: its name, args
        # The deltas of the call being read, held while it may repeat an earlier one.
        self._held: list[ToolCallDelta] | None = None
        self._repeated = False  # the reply ended at a repeated call
        runs = {
            "hermes": self._hermes,
            "llama3": self._llama3,
            "mistral": self._mistral,
            "generic": self._generic,
        }
        self._reader: Reading | None = runs[spec.format]()
        next(self._reader)

    @property
    def called(self) -> bool:
        return self._calls > 0

    @property
    def markers(self) -> frozenset[str]:
        return MARKERS[self._spec.format]

    def feed(self, text: str) -> Parsed:
        for char in text:
            self._send(char)
        return self._take()

    def finish(self) -> Parsed:
        self._send(None)
        self._reader = None
        return self._take()

    def _send(self, char: str | None) -> None:
        if self._reader is None:
            return
        try:
            self._reader.send(char)
        except StopIteration:
            self._reader = None
        except _Repeated:
            self._reader = None
            self._repeated = True

    def _take(self) -> Parsed:
        text = "".join(self._text)
        self._text.clear()
        merged: list[ToolCallDelta] = []
        for delta in self._deltas:
            last = merged[-1] if merged else None
            if last is not None and last.index == delta.index and delta.name is None:
                merged[-1] = last.model_copy(update={"arguments": last.arguments + delta.arguments})
            else:
                merged.append(delta)
        self._deltas.clear()
        return Parsed(text, tuple(merged), ended=self._repeated)

    # --- output -----------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            if self._pending:
                self._text.append(self._pending)
                self._pending = ""
            self._text.append(text)
            self._said = True

    def _open_call(self, name: str) -> int:
        if self._gap:
            # The whitespace before the call separates the text around it, if text follows.
            self._pending = self._gap if self._said else ""
            self._gap = ""
        index = self._calls
        self._calls += 1
        self._reading = (name, [])
        self._held = [] if name in self._made_names else None
        self._out().append(
            ToolCallDelta(
                index=index, id=call_id(self._spec.format, self._spec.task_id, index), name=name
            )
        )
        return index

    def _arguments(self, index: int, text: str) -> None:
        if text:
            if self._reading is not None:
                self._reading[1].append(text)
            self._out().append(ToolCallDelta(index=index, arguments=text))

    def _out(self) -> list[ToolCallDelta]:
        return self._deltas if self._held is None else self._held

    def _read_whole(self) -> None:
        """The call being read is whole: it ends the reply if it repeats an earlier one."""
        assert self._reading is not None
        name, arguments = self._reading
        key = call_key(name, "".join(arguments))
        if key is not None and key in self._made:
            self._held, self._reading = None, None
            self._calls -= 1
            raise _Repeated
        if key is not None:
            self._made.add(key)
            self._made_names.add(name)
        self._release()

    def _release(self) -> None:
        """What was held of the call being read goes out (it is whole and new, or cut off)."""
        self._deltas.extend(self._held or ())
        self._held, self._reading = None, None

    def _begin(self, lead: str) -> None:
        """Keep what is read from here on (after ``lead``), in case it is not a call."""
        self._record = [lead]

    def _spill(self) -> None:
        """What was kept was no call: it is content."""
        self._emit("".join(self._record or ()))
        self._record = None

    def _rewind(self) -> None:
        """What was kept was no call: read it again as content."""
        kept, self._record = self._record or [], None
        self._back.extend(reversed("".join(kept)))

    def _after_call(self) -> Reading:
        """Whitespace next to a call is no content."""
        self._unread((yield from self._skip_space()))

    # --- content ----------------------------------------------------------------------

    def _content(self, markers: tuple[str, ...]) -> Generator[None, str | None, str | None]:
        """Content until one of ``markers`` (returned), or the end (None)."""
        held = ""
        while True:
            char = yield from self._char()
            if char is None:
                # Whitespace that ends a reply of calls (or the JSON object) is no content.
                if held.strip() or not (self.called or self._wrapped):
                    self._emit(held)
                return None
            held += char
            for marker in markers:
                if held.endswith(marker):
                    # Held back, all of it whitespace: given back if no call follows.
                    self._gap = held[: -len(marker)]
                    return marker
            keep = _marker_start(held, markers)
            while keep > 0 and held[keep - 1] in WHITESPACE:
                keep -= 1
            self._emit(held[:keep])
            held = held[keep:]

    # --- calls ------------------------------------------------------------------------

    def _call(self, names: frozenset[str] | None) -> Generator[None, str | None, Outcome]:
        """A call's JSON object, after its ``{``. ``names``: the name must be one of them
        (a bare call). "call": read; "cut": broken after its delta went out (the text from
        the break on is left to read); "none": no call (nothing went out; what was kept, in
        ``self._record``, is for the caller to give back)."""
        before = self._calls
        try:
            yield from self._call_object(names)
        except Broken as broken:
            self._unread(broken.char)
            if self._calls == before:
                return "none"
            self._record = None
            self._release()
            return "cut"
        self._record = None
        self._read_whole()
        return "call"

    def _call_object(self, names: frozenset[str] | None) -> Reading:
        index: int | None = None
        early: list[str] = []  # arguments written before the name
        have_arguments = wrote = False

        def arguments(text: str) -> None:
            nonlocal wrote
            wrote = wrote or bool(text)
            if index is None:
                early.append(text)
            else:
                self._arguments(index, text)

        char = yield from self._skip_space()
        while char != "}":
            if char != '"':
                raise Broken(char)
            key = yield from self._string()
            char = yield from self._skip_space()
            if char != ":":
                raise Broken(char)
            char = yield from self._skip_space()
            if key == "name" and index is None and char == '"':
                name = yield from self._string()
                if names is not None and name not in names:
                    raise Broken(None)
                index = self._open_call(name)
                self._arguments(index, "".join(early))
            elif key in _ARGUMENT_KEYS and not have_arguments:
                have_arguments = True
                yield from self._value(char, arguments, decode=True)
            else:
                yield from self._value(char, _drop)
            char = yield from self._skip_space()
            if char == ",":
                char = yield from self._skip_space()
            elif char != "}":
                raise Broken(char)
        if index is None:
            raise Broken(None)
        if not wrote:
            self._arguments(index, "{}")

    def _call_list(self, names: frozenset[str] | None) -> Generator[None, str | None, str]:
        """Calls separated by commas after a ``[{`` (the ``{`` consumed, kept in
        ``self._record``), to the ``]``: "closed" when it ends so, "stopped" when something
        else came (left to read), "none" when the first is no call (what was kept is left in
        ``self._record`` for the caller)."""
        first = True
        while True:
            outcome = yield from self._call(names)
            if outcome == "none":
                if first:
                    return "none"
                self._spill()
            if outcome != "call":
                return "stopped"
            first = False
            char = yield from self._skip_space()
            if char == "]":
                return "closed"
            if char != ",":
                self._unread(char)
                return "stopped"
            char = yield from self._skip_space()
            if char != "{":
                self._unread(char)
                return "stopped"
            self._begin("{")

    # --- the formats ------------------------------------------------------------------

    def _hermes(self) -> Reading:
        while True:
            marker = yield from self._content((HERMES_OPEN,))
            if marker is None:
                return
            self._begin(self._gap + marker)
            char = yield from self._skip_space()
            if char != "{":
                self._unread(char)
                self._spill()
                continue
            outcome = yield from self._call(None)
            if outcome == "none":
                self._spill()
            elif outcome == "call":
                yield from self._after_call()
                if (yield from self._word(HERMES_CLOSE)):
                    yield from self._after_call()

    def _mistral(self) -> Reading:
        if self._spec.bare:
            # The [TOOL_CALLS] token may not show in the text: a list of calls that starts
            # the reply is one.
            self._begin("")
            char = yield from self._skip_space()
            second = (yield from self._skip_space()) if char == "[" else None
            if second == "{":
                listed = yield from self._call_list(self._spec.names)
                if listed == "none":
                    self._rewind()
                elif listed == "closed":
                    yield from self._after_call()
            else:
                self._unread(second)
                self._unread(char)
                self._rewind()
        while True:
            marker = yield from self._content((MISTRAL_CALLS,))
            if marker is None:
                return
            self._begin(self._gap + marker)
            char = yield from self._skip_space()
            if char == "[":
                char = yield from self._skip_space()
                if char == "{":
                    listed = yield from self._call_list(None)
                    if listed == "none":
                        self._spill()
                    elif listed == "closed":
                        yield from self._after_call()
                    continue
            elif char == "{":  # one call, without its list
                outcome = yield from self._call(None)
                if outcome == "none":
                    self._spill()
                elif outcome == "call":
                    yield from self._after_call()
                continue
            self._unread(char)
            self._spill()

    def _llama3(self) -> Reading:
        names: frozenset[str] | None = self._spec.names
        # A bare call is the whole reply, after whitespace.
        self._begin("")
        char = yield from self._skip_space()
        if char == "{" and self._spec.bare:
            outcome = yield from self._call(names)
            if outcome == "none":
                self._rewind()
            elif outcome == "call":
                yield from self._llama3_more(names)
        else:
            self._unread(char)
            self._rewind()
        while True:
            marker = yield from self._content((PYTHON_TAG,))
            if marker is None:
                return
            self._begin(self._gap + marker)
            char = yield from self._skip_space()
            if char != "{":
                self._unread(char)
                self._spill()
                continue
            outcome = yield from self._call(None)
            if outcome == "none":
                self._spill()
            elif outcome == "call":
                yield from self._llama3_more(None)

    def _llama3_more(self, names: frozenset[str] | None) -> Reading:
        """Calls after the first, separated by ';' (llama.cpp reads Llama's parallel calls
        so)."""
        while True:
            char = yield from self._skip_space()
            if char != ";":
                self._unread(char)  # the whitespace after a call is dropped
                return
            char = yield from self._skip_space()
            if char != "{":
                self._unread(char)
                return
            self._begin("{")
            outcome = yield from self._call(names)
            if outcome == "none":
                self._spill()
            if outcome != "call":
                return

    def _generic(self) -> Reading:
        self._begin("")
        char = yield from self._skip_space()
        if char == "{":
            try:
                yield from self._wrapper()
            except Broken as broken:
                self._unread(broken.char)
            if not self._wrapped:
                self._rewind()
        else:
            self._unread(char)
            self._rewind()
        yield from self._content(())

    def _wrapper(self) -> Reading:
        """The generic reply's object, after its ``{``."""
        char = yield from self._skip_space()
        while char != "}":
            if char != '"':
                raise Broken(char)
            key = yield from self._string()
            char = yield from self._skip_space()
            if char != ":":
                raise Broken(char)
            char = yield from self._skip_space()
            if key == "response":
                self._decided()
                yield from self._value(char, self._emit, decode=True)
            elif key == "tool_calls" and char == "[":
                self._decided()
                char = yield from self._skip_space()
                if char == "{":
                    self._begin("{")
                    listed = yield from self._call_list(None)
                    if listed == "none":
                        self._spill()
                    if listed != "closed":
                        return
                elif char != "]":
                    raise Broken(char)
            else:
                yield from self._value(char, _drop)
            char = yield from self._skip_space()
            if char == ",":
                char = yield from self._skip_space()
            elif char != "}":
                raise Broken(char)

    def _decided(self) -> None:
        """The reply is the generic JSON object: what it said before is no content."""
        self._wrapped = True
        self._record = None


def _drop(text: str) -> None:
    del text


def _marker_start(held: str, markers: tuple[str, ...]) -> int:
    """Where the longest end of ``held`` that could start a marker begins (len: none)."""
    for start in range(max(0, len(held) - max((len(m) for m in markers), default=0)), len(held)):
        tail = held[start:]
        if any(m.startswith(tail) for m in markers):
            return start
    return len(held)
