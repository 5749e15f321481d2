"""The integers between two bounds as a GBNF expression: what ``minimum``, ``maximum`` and their
exclusive forms ask of an ``integer`` (zod writes them for every ``.int().nonnegative()``, so
every TypeScript agent's integer parameter has them). llama.cpp's C++ converter builds such
rules; its Python port, which Shoal uses, does not (``grammar.py`` adds them). Pure.

Numbers are written as JSON writes them: no leading zeros, no ``-0``, a ``-`` before a
negative one. A bound of None is no bound.
"""

from __future__ import annotations


def integer_range(low: int | None, high: int | None) -> str:
    """A GBNF expression (alternatives, unparenthesised) for the integers in [low, high]."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"no integer is at least {low} and at most {high}")
    alternatives = []
    if low is None or low < 0:
        # The negatives -n: n from the smallest allowed magnitude up to -low.
        smallest = 1 if high is None or high >= 0 else -high
        alternatives.append(f'"-" ({_naturals(smallest, None if low is None else -low)})')
    if high is None or high >= 0:
        alternatives.append(_naturals(max(low or 0, 0), high))
    return " | ".join(alternatives)


def _naturals(low: int, high: int | None) -> str:
    """The natural numbers in [low, high] (0 <= low; high None: no end)."""
    alternatives = []
    if low == 0:
        alternatives.append('"0"')
        low = 1
    if high is not None and low > high:
        return alternatives[0]
    shortest = len(str(low))
    for length in range(shortest, (shortest if high is None else len(str(high))) + 1):
        first = max(low, 10 ** (length - 1))
        last = 10**length - 1 if high is None else min(high, 10**length - 1)
        alternatives += _same_length(str(first), str(last))
    if high is None:
        alternatives.append(f"[1-9] [0-9]{{{shortest},}}")  # any longer number
    return " | ".join(alternatives)


def _same_length(low: str, high: str) -> list[str]:
    """Digit strings of one length from ``low`` to ``high`` (leading zeros allowed here: these
    are a number's later digits, or the caller's own first digit is not zero)."""
    if low == high:
        return [f'"{low}"']
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [f'"{low[0]}" ({" | ".join(_same_length(low[1:], high[1:]))})']
    rest = len(low) - 1
    out = []
    middle_low, middle_high = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:
        # The first digit of ``low``, then at least the rest of it.
        out.append(f'"{low[0]}" ({" | ".join(_same_length(low[1:], "9" * rest))})')
        middle_low += 1
    tail = None
    if high[1:] != "9" * rest:
        tail = f'"{high[0]}" ({" | ".join(_same_length("0" * rest, high[1:]))})'
        middle_high -= 1
    if middle_low <= middle_high:
        first = f'"{middle_low}"' if middle_low == middle_high else f"[{middle_low}-{middle_high}]"
        out.append(f"{first} [0-9]{{{rest}}}")
    if tail is not None:
        out.append(tail)
    return out
