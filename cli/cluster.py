"""Machines that find each other: the cluster secret, discovery and the announcement, as
`shoal up` and `shoal join` use them (``services/discovery`` does the LAN's part)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Annotated

import typer

from bus.cluster_secret import ENV as SECRET_ENV
from bus.cluster_secret import ClusterSecret, WeakSecret
from services.addresses import is_loopback, is_wildcard, local_interfaces
from services.discovery.announcement import Announcement, announcement
from services.discovery.lan import Announcer, find
from services.worker.worker import VERSION

Secret = Annotated[
    str | None,
    typer.Option(
        "--secret",
        envvar=SECRET_ENV,
        show_envvar=True,
        help="The cluster's secret, the same on every machine: machines with it find each other"
        " on the LAN and authenticate to NATS with a token derived from it. At least 16"
        " characters (openssl rand -hex 16); the variable keeps it out of `ps`.",
    ),
]
# How long `shoal up` looks for a cluster of its secret before it starts one.
UP_LOOKS_S = 3.0


def use_secret(value: str | None) -> ClusterSecret | None:
    """The secret, checked, and put in the environment: every NATS connection of this process
    and of those it starts (runners) derives its token from it (``bus/nats_security.py``)."""
    if not value:
        return None
    try:
        secret = ClusterSecret(value)
    except WeakSecret as exc:
        raise typer.BadParameter(str(exc), param_hint="--secret") from None
    os.environ[SECRET_ENV] = value
    return secret


def discover(secret: ClusterSecret, timeout: float, quiet: bool = False) -> Announcement | None:
    """The cluster of ``secret`` on this LAN, looked for up to ``timeout`` seconds."""
    if not quiet:
        typer.echo(f"looking for the cluster of this secret on the LAN (up to {timeout:g} s)")
    found = asyncio.run(find(secret, timeout))
    if found.announcement is not None or quiet:
        return found.announcement
    others = len(found.others)
    seen = (
        f"; {others} other cluster(s) answered, whose secret this machine lacks" if others else ""
    )
    typer.echo(
        f"no cluster with this secret answered on the LAN within {timeout:g} s{seen}. Start the"
        " first machine with the same secret (`shoal up`), or give its NATS URL (--nats) where"
        " multicast does not pass.",
        err=True,
    )
    return None


def lan_urls(scheme: str, host: str, port: int) -> list[str]:
    """The URLs others reach a service listening on ``host`` at: every address beyond
    loopback for a wildcard, else ``host`` itself (none for a loopback one)."""
    if is_wildcard(host):
        interfaces = local_interfaces()
        # The default route's interface first: the address most machines reach this one at.
        names = sorted(interfaces.addresses, key=lambda n: (n != interfaces.default, n))
        hosts = [a for n in names for a in interfaces.addresses[n] if not is_loopback(a)]
    else:
        hosts = [] if is_loopback(host) else [host]
    return [f"{scheme}://{h}:{port}" for h in hosts]


# --- high availability (`shoal up --ha`) ----------------------------------------------------

HA_REPLICAS = 3
ROUTE_PORT = 6222


def announce(
    secret: ClusterSecret, node_id: str, nats_urls: list[str], api_url: str, routes: list[str]
) -> Announcer:
    """This node's announcement on the LAN (``Announcer.start`` sends it)."""
    hosts = [u.rsplit(":", 1)[0].split("://", 1)[1] for u in nats_urls]
    port = int(nats_urls[0].rsplit(":", 1)[1])
    found = announcement(secret, node_id, nats_urls, api_url, VERSION, routes)
    return Announcer(found, hosts, port)


def ha_peers(secret: ClusterSecret, own: str) -> list[Announcement]:
    """The other servers of this secret's HA cluster on the LAN (``own`` is this node), looked
    for a few seconds. A cluster of this secret whose server takes no routes was started
    without --ha: it cannot become one (docs/operations.md#high-availability), an error."""
    found = asyncio.run(find(secret, UP_LOOKS_S, every=True))
    found.nodes.pop(own, None)
    single = [a for a in found.nodes.values() if not a.routes]
    if single:
        urls = ",".join(single[0].nats_urls)
        typer.echo(
            f"error: the cluster of this secret at {urls} runs one NATS server (its `shoal up`"
            " had no --ha), which cannot become a cluster of several (docs/operations.md"
            "#high-availability): join it with `shoal join`, or start every machine with --ha",
            err=True,
        )
        raise typer.Exit(1)
    peers = list(found.nodes.values())
    if peers:
        typer.echo(
            f"found {len(peers)} server(s) of this cluster: {', '.join(a.node_id for a in peers)}"
        )
    return peers


@dataclass(frozen=True)
class HaServer:
    """What this node's NATS server needs to be one of the HA cluster's."""

    name: str  # the NATS cluster's
    routes: list[str]  # its own first (where the others reach it), then every peer's
    password: str  # the routes'


def ha_server(secret: ClusterSecret, own: list[str], peers: list[Announcement]) -> HaServer:
    if not own:
        raise typer.BadParameter(
            "--ha needs NATS on an address other machines reach", param_hint="--nats-host"
        )
    routes = own + [r for peer in peers for r in peer.routes if r not in own]
    return HaServer(f"shoal-{secret.cluster_id}", routes, secret.route_password)
