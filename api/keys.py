"""Who a request is: the API key it sends, resolved to a principal with a role.

Keys are of two kinds. Those given to the API process (``--api-key``, ``SHOAL_API_KEYS``) are
admin keys, as the single key always was. Those made with ``shoal keys add`` are events
(``KeyAdded``, ``KeyRevoked``) and rows of the projection (``api_keys``): the log holds a
key's SHA-256, never the key, and the API compares the digest of the key a request sends.
An API with no key of either kind is open, as before keys had roles (it listens on loopback
unless told otherwise, and `shoal up`/`shoal api` refuse more without keys) — but only while no
key was ever made: once a ``KeyAdded`` is on the log (a row of ``api_keys``, revoked or not, or
the event itself, asked of the log while the projection has none), the API fails closed,
however many keys are revoked, and a projection rebuilt before it reaches that event does not
open it again.

``user`` keys run inference and see only what they made (tasks, stored responses: another
key's are a 404, as a missing one); ``admin`` keys may do everything (``roles.py`` says which
route needs which role).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from contextvars import ContextVar
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from api.errors import ApiError
from bus.streams import EVENTS_STREAM
from events.catalogue import KeyAdded
from events.kinds import KeyRole
from projectors.rows import KeyRow
from projectors.tables import api_keys

# How long the keys read from the projection are used before they are read again: a key
# revoked stops working within this (and the projector's lag).
KEYS_TTL_S = 1.0
KEY_PREFIX = "sk-shoal-"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    """Who a request is: a key made with ``shoal keys add`` (its id and name), or one of the
    API's own keys, or nobody (an API without keys)."""

    key_id: str | None
    name: str
    role: KeyRole
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def sees(self, owner: str | None) -> bool:
        """Whether this principal may see what ``owner`` (a key id) made."""
        return self.role == "admin" or (owner is not None and owner == self.key_id)


ANONYMOUS = Principal(None, "anonymous", "admin")  # an API without keys: open
CONFIGURED = Principal(None, "api-key", "admin")  # a key the API process was given

# Set where the key is read (context.require_key), for the serving path shared by every
# dialect, which does not pass the request on.
PRINCIPAL: ContextVar[Principal] = ContextVar("shoal_principal", default=ANONYMOUS)


def current() -> Principal:
    return PRINCIPAL.get()


def new_key() -> str:
    """A new API key: 256 random bits, with a prefix that says what it is."""
    return KEY_PREFIX + secrets.token_hex(32)


def key_digest(key: str | bytes) -> str:
    """What the log keeps of a key: its SHA-256, hex."""
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


def principal_of(row: KeyRow) -> Principal:
    return Principal(row.key_id, row.name, row.role, row.requests_per_minute, row.tokens_per_minute)


def given_key(authorization: str | None, x_api_key: str | None = None) -> str:
    """The key a request sent: its ``Authorization: Bearer`` value, else ``x-api-key``."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        given = x_api_key or ""
    return given.strip()


def principal_or_refusal(
    given: str, configured: frozenset[str], made: dict[str, KeyRow], ever_made: bool = False
) -> Principal | ApiError:
    """Who a request that sent ``given`` (a header's text, '' for none) is, or its 401. The key
    given is never echoed back or logged."""
    # As bytes: any bytes a client sends (`Bearer café`, a lone surrogate) are a key that opens
    # nothing, a 401, never a 500.
    who = resolve(given.encode("utf-8", "surrogateescape"), configured, made, ever_made)
    if who is not None:
        return who
    if not given:
        return ApiError(
            401,
            "You didn't provide an API key: send `Authorization: Bearer <key>`"
            " (or `x-api-key: <key>`)",
            code="invalid_api_key",
        )
    return ApiError(401, "Incorrect API key provided", code="invalid_api_key")


def resolve(
    given: bytes, configured: frozenset[str], made: dict[str, KeyRow], ever_made: bool = False
) -> Principal | None:
    """The principal of the key a request sent (``given``, b'' for none), from the API's own
    keys and the keys made (by digest, not revoked); None when it opens nothing. With no key
    of either kind, and none ever made (``ever_made``), anyone is ``ANONYMOUS``."""
    if not configured and not made and not ever_made:
        return ANONYMOUS
    if not given:
        return None
    # Compared as bytes, in constant time: any byte sequence is a key that opens nothing.
    if any(hmac.compare_digest(given, k.encode("utf-8", "surrogateescape")) for k in configured):
        return CONFIGURED
    row = made.get(key_digest(given))
    return principal_of(row) if row is not None else None


class KeyBook:
    """The keys made with ``shoal keys add`` and not revoked, by digest, read from the
    projection at most once a ``ttl_s``; and whether any key was ever made (``ever_made``:
    once true, for good)."""

    def __init__(self, ttl_s: float = KEYS_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._read_at = -1e9
        self._by_digest: dict[str, KeyRow] | None = None
        self.ever_made = False

    async def keys(
        self, engine: AsyncEngine, js: JetStreamContext | None = None
    ) -> dict[str, KeyRow]:
        """The keys, read again when the last read is older than the TTL. A database that
        cannot be read leaves the last keys read in use; before any read, it is a 503: an API
        that cannot tell whether keys exist does not serve as if none did. While the
        projection holds no key at all, the log (``js``) is asked whether one was made (a log
        that cannot answer leaves the last answer, once there is one)."""
        now = time.monotonic()
        if now - self._read_at > self._ttl_s:
            try:
                async with engine.connect() as conn:
                    rows = [KeyRow(**r) for r in (await conn.execute(select(api_keys))).mappings()]
            except SQLAlchemyError as exc:
                if self._by_digest is None:
                    raise ApiError(503, "The API keys cannot be read yet: try again") from exc
                log.warning("the API keys could not be read again: %s", exc)
                return self._by_digest
            if rows:
                self.ever_made = True
            elif not self.ever_made and js is not None:
                try:
                    self.ever_made = await key_on_log(js)
                except ApiError:
                    # A log without a leader for a moment (a NATS server lost): the last
                    # answer stands until the next read, as for the database.
                    if self._by_digest is None:
                        raise
                    log.warning("whether an API key was made could not be read from the log")
            self._by_digest = {r.digest: r for r in rows if r.revoked_at is None}
            self._read_at = now
        return self._by_digest if self._by_digest is not None else {}


async def key_on_log(js: JetStreamContext) -> bool:
    """Whether the event log holds a ``KeyAdded`` (the projection may not have reached it:
    rebuilt, or behind). A log that cannot be asked is a 503, not an open API."""
    try:
        info = await js.stream_info(EVENTS_STREAM, subjects_filter=KeyAdded.filter_for())
    except nats.js.errors.NotFoundError:
        return False  # no log yet: nothing was ever made
    except Exception as exc:  # NATS's errors, a timeout: it cannot tell
        raise ApiError(503, "Whether API keys exist cannot be read yet: try again") from exc
    return bool(info.state.subjects)
