"""Reading generated text a character at a time, as a coroutine that is sent each character
(None at the end), with what a reply parser needs: characters read again, what a call has
consumed, whitespace, words, and JSON values read as written or decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

# A reader coroutine: sent one character at a time, None once the text ended.
Reading = Generator[None, str | None, None]
Sink = Callable[[str], None]
WHITESPACE = " \t\r\n"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_CLOSERS = {"{": "}", "[": "]"}
_HEX = "0123456789abcdefABCDEF"


class Broken(Exception):
    """The text stopped being what was expected at ``char`` (None: at the end)."""

    def __init__(self, char: str | None) -> None:
        super().__init__(char)
        self.char = char


class TextReader:
    """The input side of a reply parser: ``_char()`` takes the next character (one read
    again first), and what is read while ``_record`` is a list is kept there too."""

    def __init__(self) -> None:
        self._back: list[str] = []  # characters to read again, last first
        self._record: list[str] | None = None  # what the call being read has consumed
        self._ended = False

    def _char(self) -> Generator[None, str | None, str | None]:
        if self._back:
            char = self._back.pop()
        elif self._ended:
            return None
        else:
            sent = yield
            if sent is None:
                self._ended = True
                return None
            char = sent
        if self._record is not None:
            self._record.append(char)
        return char

    def _unread(self, char: str | None) -> None:
        if char is None:
            return
        self._back.append(char)
        if self._record:
            self._record.pop()

    def _unread_all(self, chars: str) -> None:
        for char in reversed(chars):
            self._unread(char)

    def _skip_space(self) -> Generator[None, str | None, str | None]:
        """The next character that is not whitespace (consumed), None at the end."""
        while True:
            char = yield from self._char()
            if char is None or char not in WHITESPACE:
                return char

    def _word(self, word: str) -> Generator[None, str | None, bool]:
        """Whether ``word`` comes next; consumed if so, else left to be read again."""
        seen: list[str] = []
        for expected in word:
            char = yield from self._char()
            if char != expected:
                self._unread(char)
                while seen:
                    self._unread(seen.pop())
                return False
            seen.append(char)
        return True

    # --- JSON ---------------------------------------------------------------------------

    def _string(self, out: Sink | None = None) -> Generator[None, str | None, str]:
        """A JSON string's characters after its opening quote, decoded, up to and with the
        closing quote: to ``out`` as they come, or returned."""
        parts: list[str] = []
        put = out or parts.append
        while True:
            char = yield from self._char()
            if char is None:
                raise Broken(None)
            if char == '"':
                return "".join(parts)
            if char != "\\":
                put(char)
                continue
            escape = yield from self._char()
            if escape is None:
                raise Broken(None)
            if escape != "u":
                put(_ESCAPES.get(escape, escape))  # an unknown escape: the character
                continue
            code = yield from self._hex4()
            if code is None:
                put("\ufffd")
            elif 0xD800 <= code < 0xDC00:
                low = yield from self._low_surrogate()
                put("\ufffd" if low is None else chr(0x10000 + ((code - 0xD800) << 10) + low))
            else:
                put("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code))

    def _hex4(self) -> Generator[None, str | None, int | None]:
        digits = ""
        for _ in range(4):
            char = yield from self._char()
            if char is None or char not in _HEX:
                self._unread(char)
                self._unread_all(digits)
                return None
            digits += char
        return int(digits, 16)

    def _low_surrogate(self) -> Generator[None, str | None, int | None]:
        """After a high surrogate: the low one's offset, or None (what came instead is read
        again as it is)."""
        seen = ""
        for allowed in ("\\", "u", _HEX, _HEX, _HEX, _HEX):  # each character's choices
            char = yield from self._char()
            if char is None or char not in allowed:
                self._unread(char)
                self._unread_all(seen)
                return None
            seen += char
        code = int(seen[2:], 16)
        if not 0xDC00 <= code < 0xE000:
            self._unread_all(seen)
            return None
        return code - 0xDC00

    def _raw_string(self, out: Sink) -> Generator[None, str | None, None]:
        """A JSON string after its opening quote, as written, to ``out``."""
        while True:
            char = yield from self._char()
            if char is None:
                raise Broken(None)
            out(char)
            if char == '"':
                return
            if char == "\\":
                escaped = yield from self._char()
                if escaped is None:
                    raise Broken(None)
                out(escaped)

    def _value(self, first: str | None, out: Sink, decode: bool = False) -> Reading:
        """A JSON value whose first character is ``first`` (consumed), as written, to
        ``out``; with ``decode`` a string's characters, decoded, instead."""
        if first == '"':
            if decode:
                yield from self._string(out)
            else:
                out(first)
                yield from self._raw_string(out)
            return
        if first is not None and first in _CLOSERS:
            out(first)
            open_ = [first]
            while open_:
                char = yield from self._char()
                if char is None:
                    raise Broken(None)
                if char in "}]" and char != _CLOSERS[open_[-1]]:
                    raise Broken(char)
                out(char)
                if char == '"':
                    yield from self._raw_string(out)
                elif char in _CLOSERS:
                    open_.append(char)
                elif char in "}]":
                    open_.pop()
            return
        if first is not None and (first.isalnum() or first == "-"):
            # A number, true, false or null: the text up to what cannot be part of one.
            out(first)
            while True:
                char = yield from self._char()
                if char is None or not (char.isalnum() or char in "+-."):
                    self._unread(char)
                    return
                out(char)
        raise Broken(first)
