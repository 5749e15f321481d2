"""Stop strings over a stream of text pieces.

Text that could still turn out to be the start of a stop string is held back until it is
known not to be: the client must never see a stop string, nor half of one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Emitted:
    text: str  # safe to show now
    stopped: bool  # a stop string was found; ``text`` ends just before it
    stop: str | None = None  # the stop string that was found


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> Emitted:
        text = self._held + piece
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            # The one that starts first ended the text; of two starting there, the first sent.
            cut, stop = min(found, key=lambda f: f[0])
            self._held = ""
            return Emitted(text[:cut], stopped=True, stop=stop)
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return Emitted(text[: len(text) - keep], stopped=False)

    def flush(self) -> str:
        """What is held back, once generation ended for another reason."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
