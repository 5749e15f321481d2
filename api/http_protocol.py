"""uvicorn's HTTP protocol (httptools), with its request headers bounded in size and in time.

uvicorn bounds headers only with its pure-Python h11 parser (``h11_max_incomplete_event_size``);
with httptools, the fast parser it picks when installed (as Shoal requires), a client may send
headers without end, all held in memory (100 MB of one header took 93 MB), or trickle them a
byte at a time and hold a connection for ever (slowloris): uvicorn has no timeout before a
request's headers are whole. This protocol answers such a connection and closes it:

- **431** when a request's line and headers pass ``max_header_bytes`` and are not whole yet;
- **408** when they are not whole ``header_timeout_s`` after the connection opened, or after
  the first byte of a request on a connection kept alive (between requests, uvicorn's own
  keep-alive timeout closes an idle connection).

Each in the dialect's error shape of the path, when the path has come. The body's own limits
are ``api/limits.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import resource

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.config import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES
from api.errors import ApiError, dialect_error_body, dialect_of

# The bounds of connection_limit's default.
MAX_CONNECTIONS = 1024
MIN_CONNECTIONS = 32

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


def connection_limit(configured: int | None = None, open_files: int | None = None) -> int:
    """Connections uvicorn serves at once (``limit_concurrency``; past it, each request gets a
    503): ``configured``, else half the process's limit of open files, at most 1024. The other
    half is for NATS, the database, the runners' pipes and the models' files; a process out of
    descriptors fails every accept, a 503 tells the client to come back."""
    if configured is not None:
        return configured
    if open_files is None:
        open_files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if open_files == resource.RLIM_INFINITY or open_files <= 0:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, open_files // 2))


def refusal_bytes(status: int, message: str, path: str) -> bytes:
    """A whole HTTP response refusing a request whose headers never came whole."""
    err = ApiError(
        status, message, code="request_timeout" if status == 408 else "headers_too_large"
    )
    body = json.dumps(dialect_error_body(err, dialect_of(path))).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def bounded_httptools(
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (``http=``) for these bounds."""

    class BoundedHttpTools(HttpToolsProtocol):
        _awaiting_headers = False
        _header_bytes = 0
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._expect_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._awaiting_headers:
                self._expect_headers()

        def on_headers_complete(self) -> None:
            self._awaiting_headers = False
            self._stop_timer()
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_headers and not self.transport.is_closing():
                # What a feed brings while headers are incomplete is headers (a feed's body
                # bytes of an earlier pipelined request would count too: at most one read).
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._refuse(
                        431,
                        f"The request's line and headers are more than the {max_header_bytes}"
                        " bytes this API accepts",
                    )

        def _expect_headers(self) -> None:
            self._awaiting_headers = True
            self._header_bytes = 0
            self._stop_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _stop_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self._awaiting_headers and not self.transport.is_closing():
                if self._header_bytes == 0:
                    self.transport.close()  # a connection that never asked: no answer
                    return
                self._refuse(
                    408, f"The request's headers did not arrive within {header_timeout_s:g} s"
                )

        def _refuse(self, status: int, message: str) -> None:
            url = getattr(self, "url", b"") or b""
            path = url.split(b"?", 1)[0].decode("latin-1")
            self._awaiting_headers = False
            self.transport.write(refusal_bytes(status, message, path))
            self.transport.close()

    return BoundedHttpTools
