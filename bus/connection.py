"""Connecting to NATS with the options every Shoal process uses."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import replace
from urllib.parse import urlsplit

import nats.aio.client
import nats.errors
from nats.aio.client import Client
from pydantic import SecretStr

from bus import local_token
from bus.nats_security import NatsSecurity, redact_url

log = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

# nats-py reads the socket 32 KiB at a time and pauses it with 64 KiB unread: a read, and two
# epoll changes, for every 64 KiB. A weights fetch (bus/stores/object_fetch.py) spent a third of its
# CPU there; with 1 MiB reads it fetches about 1.4 times as fast (docs/models.md). nats-py
# takes the size from this module global, when a connection is made and at each read.
nats.aio.client.DEFAULT_BUFFER_SIZE = 1024 * 1024
# A server that stops answering without closing the connection (its machine cut off the
# network, or frozen) is noticed after this many unanswered pings this far apart: about 9-12 s,
# where nats-py's defaults (2 minutes, twice) would leave a client on a partitioned server for
# up to 4 minutes before it tries another (tests/faults/test_partitions.py).
PING_INTERVAL_S = 3
MAX_OUTSTANDING_PINGS = 3


class NatsUnavailable(ConnectionError):
    pass


def server_listen_host(nc: Client) -> str | None:
    """The address the connected server says it listens on (its INFO's ``host``: ``0.0.0.0``
    when on every interface); None when it says nothing. nats-py keeps the INFO unexposed."""
    host = getattr(nc, "_server_info", {}).get("host")
    return str(host) if host else None


async def connect(
    url: str = DEFAULT_NATS_URL,
    name: str = "shoal",
    startup_timeout: float = 10.0,
    security: NatsSecurity | None = None,
) -> Client:
    """Connect; once connected, keep reconnecting forever. A server that cannot be reached
    within ``startup_timeout``, or that refuses the credentials, is a clear error, not a hang.
    Authentication and TLS come from ``security``, by default from the environment
    (``bus/nats_security.py``).

    ``url`` may list the servers of a cluster, comma-separated: they are tried in that order
    (not shuffled), so each machine can name its nearest server first. Which server the
    connection uses, and every disconnect and reconnect, is logged."""
    if security is None:
        security = NatsSecurity.from_env()
        if not security.authenticates and (token := local_token.registered(url)) is not None:
            # This user's own `shoal up` on this machine, whose API has keys.
            security = replace(security, token=SecretStr(token))
    if _password_in(url):
        log.warning(
            "the NATS URL holds a password, which the process list shows to every user of the"
            " machine: use --nats-password-file or SHOAL_NATS_PASSWORD"
        )
    nc = Client()
    connected = False
    refused: list[Exception] = []  # why connecting cannot succeed, once that is known
    hopeless = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        # Before the first connection every retry fails the same way: say it once, at the end;
        # credentials refused, or a TLS handshake that failed, will not improve by retrying.
        if connected:
            log.warning("nats: %s", exc)
        elif _hopeless(exc) and not hopeless.is_set():
            refused.append(exc)
            hopeless.set()

    async def on_disconnected() -> None:
        if connected and nc.is_reconnecting:  # not when closed
            log.warning("nats: %s disconnected; reconnecting", name)

    async def on_reconnected() -> None:
        log.warning("nats: %s reconnected to %s", name, _server(nc))

    connecting = asyncio.ensure_future(
        nc.connect(
            servers=[u.strip() for u in url.split(",")],
            name=name,
            connect_timeout=2,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            dont_randomize=True,
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **security.connect_options(),
        )
    )
    try:
        given_up = asyncio.ensure_future(hopeless.wait())
        done, _ = await asyncio.wait(
            {connecting, given_up}, timeout=startup_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        given_up.cancel()
        if connecting in done:
            connecting.result()
        elif refused:
            raise refused[0]
        else:
            raise TimeoutError()
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        connecting.cancel()
        await nc.close()
        reason = _reason(exc) or f"no answer within {startup_timeout:g}s"
        raise NatsUnavailable(
            f"cannot reach NATS at {redact_url(url)} ({security.describe()}): {reason}"
        ) from exc
    connected = True
    log.info("nats: %s connected to %s", name, _server(nc))
    return nc


def _server(nc: Client) -> str:
    """The URL of the server ``nc`` is connected to, without credentials."""
    url = nc.connected_url
    return redact_url(url.geturl()) if url is not None else "no server"


def _hopeless(exc: Exception) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError | ssl.SSLError) or (
        "authorization violation" in str(exc).lower()
    )


def _reason(exc: BaseException) -> str:
    if (
        isinstance(exc, nats.errors.AuthorizationError)
        or "authorization violation" in str(exc).lower()
    ):
        return "the server refused the credentials (Authorization Violation)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    return str(exc)


def _password_in(url: str) -> bool:
    try:
        return any(urlsplit(u.strip()).password for u in url.split(","))
    except ValueError:
        return False
