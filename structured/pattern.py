"""JSON schema ``pattern``s, rewritten for llama.cpp's schema converter.

The converter copies a pattern's pieces into GBNF almost as written, so that ``\\d`` or ``\\.``
make grammars llama.cpp refuses, and a ``.`` or ``[^,]`` lets the model write a quote, a
backslash or a newline into the string: invalid JSON. ``converter_pattern`` reads the pattern
(ECMA-262 syntax, the subset below) and writes it again in the only terms the converter
translates faithfully: literal letters, digits and spaces, character classes of ``\\xHH``
ranges, groups, ``|`` and quantifiers. Every class (``.``, ``\\d``, ``[^a]``...) is cut to the
characters a JSON string holds as they are (no control character, no ``"``, no ``\\``), so
the grammar only admits valid JSON. A pattern is matched against the whole string; without
``^`` (or ``$``) it may start (or end) anywhere, as JSON schema says.

Supported: literals, ``.``, ``[...]`` and ``[^...]`` with ranges, ``\\d \\w \\s \\D \\W \\S``,
``\\t``-style and ``\\xHH``/``\\uHHHH`` escapes, escaped punctuation, ``(...)``, ``(?:...)``,
``|``, ``* + ? {n} {n,} {n,m}`` (a lazy ``?`` after them is dropped: it changes no match),
``^`` at the start and ``$`` at the end. Not supported (``PatternError``): lookaround, named
groups, backreferences, ``\\b``, ``\\p{...}``, anchors elsewhere, possessive quantifiers, and
characters that JSON must escape (``"``, ``\\``, control characters), which a grammar for the
raw JSON text cannot express as a pattern's single character.
"""

from __future__ import annotations

from dataclasses import dataclass

# Repetition bounds above this make llama.cpp refuse the grammar (it nests one rule per step).
MAX_REPEAT = 1000
_MAX_CODEPOINT = 0x10FFFF
# What a JSON string cannot hold unescaped (the C++ converter's [^"\\\x7F\x00-\x1F]), and
# surrogates, which no UTF-8 text holds.
_FORBIDDEN: tuple[tuple[int, int], ...] = (
    (0x00, 0x1F),
    (0x22, 0x22),
    (0x5C, 0x5C),
    (0x7F, 0x7F),
    (0xD800, 0xDFFF),
)
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# ECMA-262 white space and line terminators.
_SPACE = (
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
)
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CHAR_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}
# Letters that may be escaped to mean themselves (punctuation always may).
_UNSUPPORTED_ESCAPES = {
    "b": "word boundaries (\\b)",
    "B": "word boundaries (\\B)",
    "p": "Unicode properties (\\p)",
    "P": "Unicode properties (\\P)",
    "k": "named backreferences (\\k)",
    "c": "control escapes (\\c)",
}

Ranges = tuple[tuple[int, int], ...]


class PatternError(ValueError):
    """Why a pattern cannot be honoured (the message completes "the pattern ... is not
    supported: ")."""


@dataclass
class _Item:
    text: str  # in the converter's dialect
    nullable: bool  # can match the empty string


def converter_pattern(pattern: str) -> str:
    """``pattern`` as a ``^...$`` pattern for llama.cpp's ``SchemaConverter`` (see the module
    docstring). Raises ``PatternError``."""
    return _Parser(pattern).top()


def _normalise(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(ranges: Ranges) -> Ranges:
    out = []
    at = 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, lo - 1))
        at = max(at, hi + 1)
    if at <= _MAX_CODEPOINT:
        out.append((at, _MAX_CODEPOINT))
    return tuple(out)


def _allowed(ranges: Ranges) -> Ranges:
    """``ranges`` without what a JSON string cannot hold as is."""
    return _intersect(_normalise(list(ranges)), _complement(_FORBIDDEN))


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out = []
    for lo, hi in a:
        for blo, bhi in b:
            if max(lo, blo) <= min(hi, bhi):
                out.append((max(lo, blo), min(hi, bhi)))
    return _normalise(out)


def _hex(cp: int) -> str:
    if cp < 0x100:
        return f"\\x{cp:02X}"
    if cp < 0x10000:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _class_text(ranges: Ranges) -> str:
    parts = [_hex(lo) if lo == hi else f"{_hex(lo)}-{_hex(hi)}" for lo, hi in ranges]
    return "[" + "".join(parts) + "]"


ANY_CHAR = _class_text(_complement(_FORBIDDEN))


def _literal(char: str) -> str:
    # Letters, digits and spaces are copied by the converter as they are; anything else goes
    # in a class, where the converter copies escapes untouched.
    if char.isalnum() or char == " ":
        return char
    return _class_text(((ord(char), ord(char)),))


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.src = pattern
        self.i = 0

    def fail(self, why: str) -> PatternError:
        return PatternError(why)

    def peek(self) -> str | None:
        return self.src[self.i] if self.i < len(self.src) else None

    def top(self) -> str:
        start_anchor = self.src.startswith("^")
        if start_anchor:
            self.i = 1
        body = self.alternation(depth=0)
        end_anchor = False
        if self.peek() == "$":
            self.i += 1
            end_anchor = True
        if self.i < len(self.src):
            char = self.src[self.i]
            if char == ")":
                raise self.fail("it has an unbalanced ')'")
            if char in "^$":
                raise self.fail(f"'{char}' is only supported at its start ('^') or end ('$')")
            raise self.fail(f"cannot read it at position {self.i}")  # pragma: no cover
        head = "" if start_anchor else f"{ANY_CHAR}*"
        tail = "" if end_anchor else f"{ANY_CHAR}*"
        return f"^{head}({body.text}){tail}$"

    def alternation(self, depth: int) -> _Item:
        if depth > 32:
            raise self.fail("its groups nest too deeply")
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(depth))
        return _Item("|".join(b.text for b in branches), any(b.nullable for b in branches))

    def sequence(self, depth: int) -> _Item:
        items: list[_Item] = []
        while (char := self.peek()) is not None and char not in "|)":
            if char == "$" and self.i == len(self.src) - 1 and depth == 0:
                break
            items.append(self.quantified(self.atom(depth)))
        return _Item("".join(i.text for i in items), all(i.nullable for i in items))

    def atom(self, depth: int) -> _Item:
        char = self.peek()
        assert char is not None
        if char == "(":
            self.i += 1
            if self.src.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("lookarounds and named groups ('(?') are not supported")
            inner = self.alternation(depth + 1)
            if self.peek() != ")":
                raise self.fail("it has an unclosed '('")
            self.i += 1
            return _Item(f"({inner.text})", inner.nullable)
        if char == "[":
            return _Item(self.char_class(), False)
        if char == ".":
            self.i += 1
            return _Item(ANY_CHAR, False)
        if char in "*+?{":
            raise self.fail(f"'{char}' at position {self.i} repeats nothing")
        if char in "^$":
            raise self.fail(f"'{char}' is only supported at its start ('^') or end ('$')")
        if char == "]" or char == "}":
            self.i += 1
            return _Item(_literal(char), False)
        if char == "\\":
            return self.escape_atom()
        self.i += 1
        return _Item(self.literal(char), False)

    def literal(self, char: str) -> str:
        cp = ord(char)
        if any(lo <= cp <= hi for lo, hi in _FORBIDDEN):
            raise self.fail(
                f"it requires the character {char!r}, which JSON must escape in a string"
            )
        return _literal(char)

    def escape_atom(self) -> _Item:
        kind, value = self.escape()
        if kind == "class":
            assert isinstance(value, tuple)
            return _Item(self.class_or_fail(value), False)
        assert isinstance(value, str)
        return _Item(self.literal(value), False)

    def escape(self) -> tuple[str, str | Ranges]:
        """After a backslash (at ``self.i``): ("char", c) or ("class", ranges)."""
        self.i += 1
        char = self.peek()
        if char is None:
            raise self.fail("it ends with a lone backslash")
        self.i += 1
        if char.lower() in _CLASS_ESCAPES:
            ranges = _normalise(list(_CLASS_ESCAPES[char.lower()]))
            return "class", (_complement(ranges) if char.isupper() else ranges)
        if char in _CHAR_ESCAPES:
            return "char", _CHAR_ESCAPES[char]
        if char in "xu":
            size = 2 if char == "x" else 4
            digits = self.src[self.i : self.i + size]
            if len(digits) != size or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"'\\{char}' needs {size} hexadecimal digits")
            self.i += size
            return "char", chr(int(digits, 16))
        if char in _UNSUPPORTED_ESCAPES:
            raise self.fail(f"{_UNSUPPORTED_ESCAPES[char]} are not supported")
        if char.isdigit():
            raise self.fail("backreferences and '\\0' are not supported")
        if char.isalnum():
            raise self.fail(f"the escape '\\{char}' is not supported")
        return "char", char

    def class_or_fail(self, ranges: Ranges) -> str:
        allowed = _allowed(ranges)
        if not allowed:
            raise self.fail("one of its classes holds only characters JSON must escape")
        return _class_text(allowed)

    def char_class(self) -> str:
        self.i += 1  # the '['
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            char = self.peek()
            if char is None:
                raise self.fail("it has an unclosed '['")
            if char == "]" and not first:
                self.i += 1
                break
            first = False
            low = self.class_atom()
            if isinstance(low, tuple):
                ranges.extend(low)
                continue
            if self.peek() == "-" and self.src[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.class_atom()
                if isinstance(high, tuple):
                    raise self.fail("a range in a class ends in a class escape")
                if ord(high) < ord(low):
                    raise self.fail(f"the range {low!r}-{high!r} is backwards")
                ranges.append((ord(low), ord(high)))
            else:
                ranges.append((ord(low), ord(low)))
        chosen = _normalise(ranges)
        return self.class_or_fail(_complement(chosen) if negated else chosen)

    def class_atom(self) -> str | Ranges:
        char = self.peek()
        assert char is not None
        if char != "\\":
            self.i += 1
            return char
        if self.src[self.i + 1 : self.i + 2] == "b":  # a backspace, inside a class
            self.i += 2
            return "\b"
        return self.escape()[1]

    def quantified(self, item: _Item) -> _Item:
        char = self.peek()
        if char is None or char not in "*+?{":
            return item
        low, high = self.quantifier()
        if self.peek() == "?":  # lazy: the same strings match
            self.i += 1
        if (next_char := self.peek()) is not None and next_char in "*+?{":
            raise self.fail("a quantifier follows another (possessive or nested quantifiers)")
        # Unbounded repetition of what can be empty loops in llama.cpp's grammar engine.
        if item.nullable and high is None:
            raise self.fail("it repeats something that can match nothing")
        if low == 0 and high == 0:
            return _Item("", True)
        if (low, high) == (0, None):
            suffix = "*"
        elif (low, high) == (1, None):
            suffix = "+"
        elif (low, high) == (0, 1):
            suffix = "?"
        elif high is None:
            suffix = f"{{{low},}}"
        elif low == high:
            suffix = f"{{{low}}}"
        else:
            suffix = f"{{{low},{high}}}"
        return _Item(item.text + suffix, item.nullable or low == 0)

    def quantifier(self) -> tuple[int, int | None]:
        char = self.peek()
        self.i += 1
        if char == "*":
            return 0, None
        if char == "+":
            return 1, None
        if char == "?":
            return 0, 1
        end = self.src.find("}", self.i)
        body = self.src[self.i : end] if end != -1 else ""
        parts = body.split(",")
        if end == -1 or len(parts) > 2 or not all(p.isdigit() or p == "" for p in parts):
            raise self.fail(f"'{{' at position {self.i - 1} is no quantifier (escape it: '\\{{')")
        if parts[0] == "" and (len(parts) == 1 or parts[1] == ""):
            raise self.fail(f"'{{' at position {self.i - 1} is no quantifier")
        self.i = end + 1
        low = int(parts[0]) if parts[0] else 0
        high: int | None = low if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if high is not None and high < low:
            raise self.fail(f"the quantifier {{{body}}} is backwards")
        if max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"its repetitions go above {MAX_REPEAT}")
        return low, high
