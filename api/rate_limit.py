"""Per-key rate limits: requests and tokens a minute, as a key was made with (``shoal keys add
--requests-per-minute/--tokens-per-minute``). Counted by each API process over the last
minute (a sliding window): with several API processes, each lets a key through up to its
limit. Tokens are counted when a task ends (prompt and generated): a key over its tokens waits
until the window has room again."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60.0


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0

    def forget_before(self, t: float) -> None:
        while self.requests and self.requests[0] <= t:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= t:
            self.token_sum -= self.tokens.popleft()[1]


class RateLimits:
    """Each key's requests and tokens of the last minute; what memory it takes is bounded by
    its limit (a request refused is not counted) and by the window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def refusal(
        self, key_id: str, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> float | None:
        """None when the key may make a request now (counted), else the seconds until it may
        (for Retry-After)."""
        if requests_per_minute is None and tokens_per_minute is None:
            return None
        now = self._clock()
        w = self._windows.setdefault(key_id, _Window())
        w.forget_before(now - WINDOW_S)
        if requests_per_minute is not None and len(w.requests) >= requests_per_minute:
            return max(0.0, w.requests[0] + WINDOW_S - now)
        if tokens_per_minute is not None and w.token_sum >= tokens_per_minute:
            # Room again once enough of the oldest have left the window.
            excess, at = w.token_sum - tokens_per_minute, w.tokens[0][0]
            for t, n in w.tokens:
                at = t
                excess -= n
                if excess < 0:
                    break
            return max(0.0, at + WINDOW_S - now)
        w.requests.append(now)
        return None

    def would_refuse(
        self, key_id: str, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> bool:
        """Whether ``refusal`` would refuse the key now (nothing counted)."""
        w = self._windows.get(key_id)
        if w is None:
            return False
        w.forget_before(self._clock() - WINDOW_S)
        return (requests_per_minute is not None and len(w.requests) >= requests_per_minute) or (
            tokens_per_minute is not None and w.token_sum >= tokens_per_minute
        )

    def used(self, key_id: str, tokens: int) -> None:
        """Tokens a key's task used, once it ended."""
        w = self._windows.get(key_id)
        if w is None or tokens <= 0:
            return
        w.tokens.append((self._clock(), tokens))
        w.token_sum += tokens


def retry_after(seconds: float) -> str:
    """Whole seconds, at least one (the header's form)."""
    return str(max(1, math.ceil(seconds)))
