"""What a cluster says of itself on the LAN, signed with its secret (pure: no network here).

An announcement carries the public cluster id, the NATS URLs a machine joins at, the API's URL
when it listens beyond loopback, and a proof: an HMAC of all of these under a key derived from
the secret. A machine that has the secret recognises its cluster by the id and checks the
proof; one without it learns nothing it could join with (the NATS token is derived from the
secret too), and a forged announcement pointing elsewhere fails the proof. A replayed one
points at the real cluster, which is harmless.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from bus.cluster_secret import ClusterSecret

SERVICE_TYPE = "_shoal._tcp.local."
# DNS-SD TXT strings are at most 255 bytes each: at most this many NATS URLs are announced.
MAX_URLS = 4


def announcement(
    secret: ClusterSecret,
    node_id: str,
    nats_urls: list[str],
    api_url: str,
    version: str,
    routes: list[str] | None = None,
) -> Announcement:
    """This node's announcement, signed."""
    unsigned = Announcement(
        secret.cluster_id,
        node_id,
        tuple(nats_urls[:MAX_URLS]),
        api_url,
        version,
        tuple((routes or [])[:MAX_URLS]),
    )
    return unsigned.signed(secret)


@dataclass(frozen=True)
class Announcement:
    cluster_id: str
    node_id: str
    nats_urls: tuple[str, ...]
    api_url: str = ""
    version: str = ""
    # Where this node's NATS server takes routes from the other servers of an HA cluster
    # (``nats-route://host:port``, no credentials); none for a single server.
    routes: tuple[str, ...] = ()
    proof: str = ""

    def _message(self) -> bytes:
        fields = asdict(self) | {"proof": ""}
        return json.dumps(fields, sort_keys=True).encode()

    def signed(self, secret: ClusterSecret) -> Announcement:
        return Announcement(**(asdict(self) | {"proof": secret.sign(self._message())}))

    def proven_by(self, secret: ClusterSecret) -> bool:
        """Whether this announcement is of ``secret``'s cluster and signed with it."""
        return self.cluster_id == secret.cluster_id and secret.verify(self._message(), self.proof)

    def properties(self) -> dict[str, str]:
        """As DNS-SD TXT properties."""
        return {
            "c": self.cluster_id,
            "n": self.node_id,
            "u": ",".join(self.nats_urls),
            "a": self.api_url,
            "v": self.version,
            "r": ",".join(self.routes),
            "p": self.proof,
        }

    @classmethod
    def from_properties(cls, props: Mapping[bytes, bytes | None]) -> Announcement | None:
        """From TXT properties; None when they are not a Shoal announcement."""

        def get(key: str) -> str:
            value = props.get(key.encode())
            return value.decode(errors="replace") if value else ""

        if not get("c") or not get("u") or not get("p"):
            return None
        return cls(
            cluster_id=get("c"),
            node_id=get("n"),
            nats_urls=tuple(u for u in get("u").split(",") if u),
            api_url=get("a"),
            version=get("v"),
            routes=tuple(r for r in get("r").split(",") if r),
            proof=get("p"),
        )
