"""Addresses: which are this machine's alone (loopback), and the address a node gives the
others for what they connect to on it: its pipeline stages (llama.cpp RPC, the MLX ring) and
its weights server.

It must be one the other machines can reach. The rule, in order:

1. ``--data-host``, when given;
2. NATS on another machine: the local address of the route towards it (the interface the
   others most likely reach this one on);
3. NATS on this machine, listening beyond loopback (other machines may join): this machine's
   LAN address — the interface of the default route, else its only non-loopback address;
4. everything on loopback (a one-machine cluster): 127.0.0.1.

A loopback address is never chosen when other machines may be in the cluster (2 and 3); the
choice and why are in the node's ``NodeJoined`` and in ``shoal state``.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Advertised:
    address: str
    why: str


@dataclass(frozen=True)
class Interfaces:
    """What the choice needs to know of this machine's network."""

    addresses: dict[str, list[str]]  # interface -> its IPv4 addresses (up interfaces only)
    default: str | None = None  # the interface of the default route


LOCALHOST = "localhost"


def ip_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (brackets and an IPv6 zone left out), or None."""
    try:
        return ipaddress.ip_address(text.strip("[]").partition("%")[0])
    except ValueError:
        return None


def normal_host(name: str) -> str:
    """A host as compared: lowercased, without a final dot; an address in its short form."""
    address = ip_address(name)
    if address is not None:
        return str(address)
    return name.strip().lower().rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether an address (or a name) is this machine's alone."""
    if normal_host(host) == LOCALHOST:
        return True
    address = ip_address(host)
    return address is not None and address.is_loopback


def is_wildcard(host: str) -> bool:
    """Whether listening on ``host`` listens on every address (0.0.0.0, ::)."""
    address = ip_address(host)
    return host.strip() == "" or (address is not None and address.is_unspecified)


def _here(host: str) -> bool:
    """A host that names this machine whatever its addresses: loopback, or a wildcard."""
    return is_loopback(host) or is_wildcard(host)


def nats_hosts(nats_url: str) -> list[str]:
    """The hosts of a (comma-separated) NATS URL list."""
    hosts = []
    for url in nats_url.split(","):
        try:
            host = urlsplit(url.strip()).hostname
        except ValueError:
            host = None
        hosts.append(host or LOOPBACK)
    return hosts


def choose(
    given: str | None,
    nats_url: str,
    route_source: str | None,
    open_beyond_loopback: bool,
    interfaces: Interfaces,
) -> Advertised:
    """The address to advertise and why (pure: what the machine is like comes in).

    ``route_source``: the local address of the route towards the first NATS host that is not
    loopback (None when there is none, or no route); ``open_beyond_loopback``: the NATS server
    this node uses on this machine listens beyond loopback."""
    if given:
        return Advertised(given, "given (--data-host)")
    remote = next((h for h in nats_hosts(nats_url) if not _here(h)), None)
    if remote is not None and route_source and not is_loopback(route_source):
        return Advertised(route_source, f"this machine's address on the route to NATS at {remote}")
    if remote is None and not open_beyond_loopback:
        return Advertised(LOOPBACK, "NATS listens on loopback only: no other machine can join")
    lan = _lan_address(interfaces)
    if lan is None:
        return Advertised(
            LOOPBACK,
            "no address beyond loopback on this machine: other machines cannot reach it",
        )
    address, why = lan
    if remote is None:
        why += " (NATS here listens beyond loopback: other machines may join)"
    return Advertised(address, why)


def _lan_address(interfaces: Interfaces) -> tuple[str, str] | None:
    default = interfaces.default
    if default and (addresses := interfaces.addresses.get(default)):
        return addresses[0], f"the address of {default}, the default route's interface"
    candidates = [
        (name, a)
        for name, addrs in sorted(interfaces.addresses.items())
        for a in addrs
        if not is_loopback(a)
    ]
    if not candidates:
        return None
    name, address = candidates[0]
    if len(candidates) == 1:
        return address, f"the only address beyond loopback ({name})"
    others = ", ".join(a for _, a in candidates[1:])
    return address, f"the first of several addresses ({name}; also {others}: --data-host chooses)"


# --- what this machine is like (I/O) --------------------------------------------------------


def route_source(host: str) -> str | None:
    """The local address this machine would send to ``host`` from (a UDP "connection" sends
    nothing; it only picks a route), or None when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def local_interfaces() -> Interfaces:
    stats = psutil.net_if_stats()
    addresses = {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
        if name in stats and stats[name].isup
    }
    return Interfaces({n: a for n, a in addresses.items() if a}, _default_route_interface())


def _default_route_interface() -> str | None:
    """The interface of the IPv4 default route (Linux's route table; elsewhere None)."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return fields[0]
    return None


def advertised(given: str | None, nats_url: str, open_beyond_loopback: bool) -> Advertised:
    """``choose`` for this machine."""
    remote = next((h for h in nats_hosts(nats_url) if not _here(h)), None)
    source = None if remote is None else route_source(remote)
    return choose(given, nats_url, source, open_beyond_loopback, local_interfaces())
