"""A worker's weights server: the files its node's cache holds, given to the runners of other
nodes over plain HTTP, so that a model on one machine's disk needs no second copy (in the
models bucket) for another machine to run it.

- It answers ``WeightsWanted`` (``services/models/weight_offers.py``) for the files its cache
  holds with a ``WeightsOffer``: its URL and a ticket for those files. Asking needs the
  cluster's NATS credentials; the ticket is what the HTTP side checks, so the port gives
  nothing to whoever cannot ask.
- ``GET /blobs/<sha256>`` with ``Authorization: Bearer <ticket>`` sends the blob with the
  kernel's ``sendfile`` (no copy through Python), from the offset of a ``Range: bytes=N-``
  (a resumed fetch).

It listens on the node's data host (where its pipeline stages listen too), on a port the
system picks: the offer says which.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from events.subjects import WEIGHTS_WANTED
from services.models.weight_offers import WeightsOffer, WeightsWanted
from services.models.weights_cache import WeightsCache

log = logging.getLogger(__name__)

# How long a ticket lets its holder start reading (a transfer under way goes on past it).
TICKET_S = 600.0
# A client that neither reads nor sends for this long, once its ticket was taken, is dropped.
CLIENT_TIMEOUT_S = 60.0
# How long a client may take to send its request's head (and its ticket): the port is open to
# the node's network, and a connection that says nothing holds a thread.
HEAD_TIMEOUT_S = 5.0
# Connections served at once (a thread each); past it, a connection is closed at once.
MAX_CONNECTIONS = 64

_BLOB = re.compile(r"^/blobs/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d+)-$")


class WeightsServer:
    def __init__(self, cache: WeightsCache, host: str, node_id: str) -> None:
        self.cache = cache
        self.node_id = node_id
        self._host = host
        self._tickets: dict[str, tuple[frozenset[str], float]] = {}
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._http is not None, "not started"
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._http = _CappedServer((self._host, 0), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="weights-server", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    async def answer(self, nc: Client) -> Subscription:
        """Answer other nodes' asks for the files this node's cache holds."""

        async def on_wanted(msg: Msg) -> None:
            try:
                wanted = WeightsWanted.model_validate_json(msg.data)
            except ValidationError:
                return
            held = [f.sha256 for f in wanted.files if self.cache.holds(f)]
            if wanted.node_id == self.node_id or not held or not msg.reply:
                return
            offer = WeightsOffer(
                node_id=self.node_id, url=self.url, ticket=self.ticket_for(held), sha256s=held
            )
            await msg.respond(offer.model_dump_json().encode())

        return await nc.subscribe(WEIGHTS_WANTED, cb=on_wanted)

    def ticket_for(self, sha256s: list[str]) -> str:
        ticket = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            # The tickets of the last TICKET_S: as many as asks answered in that time.
            for old in [t for t, (_, until) in self._tickets.items() if until < now]:
                del self._tickets[old]
            self._tickets[ticket] = (frozenset(sha256s), now + TICKET_S)
        return ticket

    def allows(self, ticket: str, sha256: str) -> bool:
        now = time.monotonic()
        with self._lock:
            entries = list(self._tickets.items())
        given = ticket.encode()
        return any(
            hmac.compare_digest(t.encode(), given) and sha256 in shas and until >= now
            for t, (shas, until) in entries
        )


class _CappedServer(ThreadingHTTPServer):
    """At most ``MAX_CONNECTIONS`` connections at once (a thread each): one more is closed
    unanswered, before a thread is started for it."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            log.warning("weights server: %d connections already: one refused", MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _handler(server: WeightsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Until the ticket is checked: a few seconds. Then a transfer's pauses may be longer.
        timeout = HEAD_TIMEOUT_S

        def do_GET(self) -> None:
            match = _BLOB.match(self.path)
            auth = self.headers.get("Authorization", "")
            ticket = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
            if match is None:
                self.send_error(404, "no such path: GET /blobs/<sha256>")
                return
            sha256 = match.group(1)
            if not ticket or not server.allows(ticket, sha256):
                self.send_error(403, "no valid ticket for this file: ask over NATS first")
                return
            self.connection.settimeout(CLIENT_TIMEOUT_S)
            try:
                blob = server.cache.blob(sha256).open("rb")
            except OSError:
                self.send_error(404, "this node does not hold that file (any more)")
                return
            with blob:
                size = blob.seek(0, 2)
                wanted = _RANGE.match(self.headers.get("Range", ""))
                offset = int(wanted.group(1)) if wanted else 0
                if offset > size:
                    self.send_error(416, f"the file has {size} bytes")
                    return
                self.send_response(206 if wanted else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size - offset))
                if wanted:
                    self.send_header("Content-Range", f"bytes {offset}-{size - 1}/{size}")
                self.end_headers()
                if size > offset:
                    self.connection.sendfile(blob, offset, size - offset)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("weights server: " + format, *args)

    return Handler
