"""Which ``Host`` and ``Origin`` a request may come with: what keeps web pages from driving the
API through a browser (the class of Ollama's CVE-2024-28224).

- **DNS rebinding.** A page of ``http://evil.example:8000`` whose name the attacker then points
  at 127.0.0.1 makes the browser send the page's requests to the API, as same-origin requests
  it may read the answers of, with ``Host: evil.example:8000``. So the API answers only to the
  names it is known by (``host_allowed``): loopback names and addresses, the address it listens
  on, this machine's names and addresses when it listens beyond loopback, and the names given
  with ``--allowed-host``.
- **Cross-site requests.** A page of any origin may send a "simple" request (a form's POST) to
  ``http://127.0.0.1:8000`` without a preflight; the browser sends its ``Origin``, and the API
  refuses an origin that is neither its own nor one given with ``--cors-origin``
  (``origin_allowed``). SDKs, curl and servers (Open WebUI's backend) send no ``Origin``.

These are pure functions of the request's headers and of a ``HostPolicy`` made once at start
(``host_policy``); ``api/limits.py`` applies them at the edge.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

from services.addresses import ip_address as _address
from services.addresses import is_loopback, is_wildcard, normal_host

# Given to --allowed-host: any Host (behind a proxy that checks names itself).
ANY_HOST = "*"
# The machine's addresses are read again at most this often, when a Host names an address not
# among them (an address that DHCP gave since).
ADDRESSES_TTL_S = 10.0

_DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_host(header: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an origin's authority) as its host, normalised, and its port, or
    None when it is no such thing: ``example.com:8000``, ``[::1]:8000``, ``127.0.0.1``."""
    text = header.strip()
    port_text: str | None = None
    if text.startswith("["):
        name, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        name, _, port_text = text.partition(":")
    else:
        name = text  # no port, or a bare IPv6 address
    if not name or any(c in name for c in "/@?#\\ ") or not name.isascii():
        return None
    port = None
    if port_text is not None:
        if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
            return None
        port = int(port_text)
    return normal_host(name), port


def machine_names(hostname: str | None = None) -> frozenset[str]:
    """The names this machine is reached by on a LAN: its host name, its first label, and that
    label under ``.local`` (what mDNS, macOS's Bonjour and Linux's Avahi, answers to)."""
    name = normal_host(hostname if hostname is not None else socket.gethostname())
    if not name or _address(name) is not None:
        return frozenset()
    short = name.split(".")[0]
    return frozenset({name, short, f"{short}.local"})


def interface_addresses() -> frozenset[str]:
    """Every address of this machine's network interfaces, normalised."""
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                address = _address(a.address)
                if address is not None:
                    found.add(str(address))
    return frozenset(found)


class RecentAddresses:
    """``interface_addresses()``, read again when asked after ``ttl_s``."""

    def __init__(
        self,
        read: Callable[[], frozenset[str]] = interface_addresses,
        ttl_s: float = ADDRESSES_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read, self._ttl_s, self._clock = read, ttl_s, clock
        self._addresses = read()
        self._read_at = clock()

    def __call__(self, fresh: bool = False) -> frozenset[str]:
        """The addresses; with ``fresh``, read again unless they were read a moment ago."""
        if fresh and self._clock() - self._read_at >= self._ttl_s:
            self._addresses = self._read()
            self._read_at = self._clock()
        return self._addresses


@dataclass(frozen=True)
class HostPolicy:
    """The names a request's ``Host`` may give (normalised), besides loopback ones."""

    names: frozenset[str] = frozenset()
    any_host: bool = False  # --allowed-host '*'
    machine: bool = False  # the machine's names are among them (it listens beyond loopback)
    # This machine's interface addresses, when the API listens on all of them (None: it does
    # not); called with fresh=True when a Host names an address not among them.
    addresses: Callable[..., frozenset[str]] | None = None

    def describe(self) -> str:
        """What the API answers to, for the error that refuses a Host. It names no address nor
        name of the machine: a page that rebound a name to the API could read it."""
        parts = ["localhost and loopback addresses"]
        if self.addresses is not None:
            parts.append("this machine's names and addresses")
        elif self.machine:
            parts.append("the address it listens on and this machine's names")
        return ", ".join(parts) + ", and the names given with --allowed-host"


def host_policy(
    listen_hosts: Iterable[str],
    allowed_hosts: Iterable[str] = (),
    names: Callable[[], frozenset[str]] = machine_names,
    addresses: Callable[..., frozenset[str]] | None = None,
) -> HostPolicy:
    """The policy of an API that listens on ``listen_hosts`` (its ``--host``), also answering
    to ``allowed_hosts`` (``--allowed-host``; ``*`` for any). Beyond loopback, the machine's
    names too (a LAN's users type them); on every address (0.0.0.0), the machine's addresses
    as well, read when needed (``addresses``, by default the interfaces')."""
    allowed = {normal_host(h) for h in allowed_hosts if h.strip()}
    listen = list(listen_hosts)
    everywhere = any(is_wildcard(h) for h in listen)
    allowed |= {normal_host(h) for h in listen if not is_wildcard(h)}
    machine = any(not is_loopback(h) for h in listen)
    if machine:
        allowed |= names()
    if everywhere and addresses is None:
        addresses = RecentAddresses()
    return HostPolicy(
        names=frozenset(allowed - {ANY_HOST}),
        any_host=ANY_HOST in allowed,
        machine=machine,
        addresses=addresses if everywhere else None,
    )


def host_allowed(header: str | None, policy: HostPolicy) -> bool:
    """Whether a request with this ``Host`` header may be answered. A request without one
    (HTTP/1.0) was not sent by a browser, which always sends it."""
    if header is None or policy.any_host:
        return True
    classified = _classified(header)
    if classified is None:
        return False
    host, loopback, address = classified
    if loopback or host in policy.names:
        return True
    if policy.addresses is None or not address:
        return False
    return host in policy.addresses() or host in policy.addresses(fresh=True)


@functools.lru_cache(maxsize=1024)
def _classified(header: str) -> tuple[str, bool, bool] | None:
    """A Host header's host, whether it is a loopback one, whether it is an address: what
    every request asks, remembered (parsing an address costs more than the rest of the
    checks together)."""
    parsed = parse_host(header)
    if parsed is None:
        return None
    host = parsed[0]
    return host, is_loopback(host), _address(host) is not None


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is the API's own, addressed as ``host``
    (the request's ``Host``): the dashboard's requests. The port of either, when not given, is
    the default of the origin's scheme."""
    if host is None:
        return False
    try:
        parts = urlsplit(origin)
        scheme = parts.scheme.lower()
        origin_host = parse_host(parts.netloc)
    except ValueError:
        return False
    requested = parse_host(host)
    if scheme not in _DEFAULT_PORTS or origin_host is None or requested is None:
        return False
    if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
        return False
    default = _DEFAULT_PORTS[scheme]
    (name, port), (host_name, host_port) = origin_host, requested
    return name == host_name and (port or default) == (host_port or default)


def origin_allowed(origin: str | None, host: str | None, cors_origins: Iterable[str]) -> bool:
    """Whether a request carrying this ``Origin`` header may be answered: none (not a
    browser's page, or a same-origin GET), the API's own origin, or one of ``cors_origins``
    (``--cors-origin``; ``*``: any), compared as CORS compares them (the exact text)."""
    if origin is None:
        return True
    allowed = set(cors_origins)
    return "*" in allowed or origin in allowed or same_origin(origin, host)
