"""What one client of the live event feed (``GET /v1/events``) has waiting to be sent: bounded
in bytes, so that a client that cannot keep up costs the API a fixed amount of memory, and is
told so and let go rather than silently losing events."""

from __future__ import annotations

import json
from collections import deque
from typing import Generic, TypeVar

from api.errors import error_body
from events.units import MiB

T = TypeVar("T")

OVERFLOW_CODE = "events_overflow"


class FeedBuffer(Generic[T]):
    """Items waiting to be sent, with their sizes, up to ``limit`` bytes in all.

    An item that would take the buffer over the limit overflows it: everything waiting is
    dropped at once (the memory is what matters, and the client is to be let go anyway) and
    every later item is refused. An item larger than the whole limit is still taken into an
    empty buffer: else an event of that size could never reach even a client that keeps up.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"the buffer's limit must be positive, not {limit}")
        self.limit = limit
        self.size = 0  # bytes waiting
        self.overflowed = False
        self._items: deque[tuple[T, int]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: T, size: int) -> bool:
        """Keep ``item`` (``size`` bytes) to be sent; False: refused, the buffer overflowed
        (now or before)."""
        if self.overflowed:
            return False
        if self._items and self.size + size > self.limit:
            self.overflowed = True
            self._items.clear()
            self.size = 0
            return False
        self._items.append((item, size))
        self.size += size
        return True

    def take(self) -> T | None:
        """The oldest item waiting, or None when none is."""
        if not self._items:
            return None
        item, size = self._items.popleft()
        self.size -= size
        return item


def overflow_event(limit: int) -> str:
    """The feed's last event to a client that could not keep up: why it is disconnected."""
    message = (
        f"this client cannot keep up with the event feed: more than {limit / MiB:.3g} MiB of"
        " events waited to be sent to it, so it is disconnected; reconnect (with ?last=N"
        " for the events it missed)"
    )
    data = json.dumps(error_body(503, message, code=OVERFLOW_CODE), separators=(",", ":"))
    return f"event: error\ndata: {data}\n\n"
