"""The size limit of a NATS message, headers included.

nats-py checks only the payload against the server's ``max_payload``, but the server counts the
headers too, and answers a message over the limit by closing the connection, which nats-py then
never reopens (every later call raises ConnectionClosedError). So whoever adds headers to a
payload that may be large checks the whole message first.
"""

from __future__ import annotations

from collections.abc import Mapping

import nats.errors
from nats.js import JetStreamContext

_HEADER_FRAME = len(b"NATS/1.0\r\n\r\n")


class PayloadTooLargeError(nats.errors.MaxPayloadError):
    """A message larger than the server accepts (its ``max_payload``, headers included)."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__()
        self.subject = subject
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return (
            f"nats: the message for {self.subject} is {self.size} bytes with its headers, more"
            f" than the server's max_payload of {self.limit} bytes"
        )


def message_size(payload: bytes, headers: Mapping[str, str] | None = None) -> int:
    """The bytes the server counts against ``max_payload``: the payload and the headers in
    their ``NATS/1.0`` block (an upper bound: values are sent stripped)."""
    if not headers:
        return len(payload)
    lines = sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())  # "k: v\r\n"
    return len(payload) + _HEADER_FRAME + lines


def max_payload(js: JetStreamContext) -> int:
    """The largest message the connected server accepts."""
    limit: int = js._nc.max_payload  # the context has no public accessor for its client
    return limit


def check_size(
    js: JetStreamContext, subject: str, payload: bytes, headers: Mapping[str, str] | None = None
) -> None:
    """Raise PayloadTooLargeError, before sending, for a message the server would refuse."""
    size, limit = message_size(payload, headers), max_payload(js)
    if size > limit:
        raise PayloadTooLargeError(subject, size, limit)
