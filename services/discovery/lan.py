"""Finding a cluster on the LAN, and saying where this one is: mDNS / DNS-SD (``zeroconf``).

A node that runs the cluster's NATS server announces the service ``_shoal._tcp.local.``, its
TXT properties an ``Announcement`` (``announcement.py``). A machine joining browses for it and
takes the first announcement its own secret proves. DNS-SD rather than a protocol of our own:
it is the LAN's standard (the same packets as printers and AirPlay, on 224.0.0.251:5353),
``zeroconf`` handles every interface and the records' lifetimes, and ``avahi-browse
_shoal._tcp`` shows what Shoal announces. Where multicast does not pass (some Wi-Fi, VPNs,
clouds), ``--nats URL`` joins instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from dataclasses import dataclass, field

from zeroconf import IPVersion, ServiceInfo, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from bus.cluster_secret import ClusterSecret
from services.discovery.announcement import SERVICE_TYPE, Announcement

log = logging.getLogger(__name__)


def _service_name(announcement: Announcement) -> str:
    # A DNS label is at most 63 bytes: the cluster id and a digest of the node's id.
    node = hashlib.sha256(announcement.node_id.encode()).hexdigest()[:12]
    return f"shoal-{announcement.cluster_id}-{node}.{SERVICE_TYPE}"


class Announcer:
    """Announces ``announcement`` on every interface from ``start`` until ``stop``, from
    zeroconf's own thread (so not from within an event loop: its calls block)."""

    def __init__(self, announcement: Announcement, addresses: list[str], port: int) -> None:
        self.announcement = announcement
        self._info = ServiceInfo(
            SERVICE_TYPE,
            _service_name(announcement),
            addresses=[socket.inet_aton(a) for a in addresses],
            port=port,
            properties=announcement.properties(),
        )
        self._zc: Zeroconf | None = None

    def start(self) -> None:
        self._zc = Zeroconf(ip_version=IPVersion.V4Only)
        self._zc.register_service(self._info)

    def stop(self) -> None:
        zc, self._zc = self._zc, None
        if zc is not None:
            zc.unregister_service(self._info)
            zc.close()


@dataclass
class Found:
    """What a search saw: the announcements of this secret's cluster, by node (none: not
    seen), and the other clusters' ids seen (whose secret this machine lacks)."""

    nodes: dict[str, Announcement] = field(default_factory=dict)
    others: set[str] = field(default_factory=set)

    @property
    def announcement(self) -> Announcement | None:
        return next(iter(self.nodes.values()), None)


async def find(secret: ClusterSecret, timeout: float, every: bool = False) -> Found:
    """Browse the LAN for ``secret``'s cluster: until the first announcement of it, or, with
    ``every``, for all of ``timeout`` seconds (every node of it that announces)."""
    found = Found()
    done = asyncio.Event()
    pending: set[asyncio.Task[None]] = set()
    zc = AsyncZeroconf(ip_version=IPVersion.V4Only)

    async def look(name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zc.zeroconf, 3000):
            return
        seen = Announcement.from_properties(dict(info.properties))
        if seen is None:
            return
        if seen.proven_by(secret):
            found.nodes[seen.node_id] = seen
            if not every:
                done.set()
        else:
            found.others.add(seen.cluster_id)
            if seen.cluster_id == secret.cluster_id:
                log.warning("an announcement of this cluster's id with a wrong proof: ignored")

    def on_change(
        zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.ensure_future(look(name))
            pending.add(task)
            task.add_done_callback(pending.discard)

    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        await browser.async_cancel()
        for task in pending:
            task.cancel()
        await zc.async_close()
    return found
