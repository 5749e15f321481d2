"""The cluster's secret, and what is derived from it.

One secret, the same on every machine (``SHOAL_CLUSTER_SECRET`` or ``--secret``), stands for
all a machine needs to join: the NATS token every process authenticates with is derived from
it, and so are the public cluster id that discovery's announcements carry (to keep clusters on
one LAN apart) and the key that signs them (a proof of the secret, never the secret). Each is
an HMAC-SHA256 of the secret with its own label, so one reveals nothing of the others.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

ENV = "SHOAL_CLUSTER_SECRET"
MIN_LENGTH = 16


class WeakSecret(ValueError):
    pass


def _derive(secret: str, label: str) -> bytes:
    return hmac.new(secret.encode(), label.encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class ClusterSecret:
    value: str

    def __post_init__(self) -> None:
        if len(self.value) < MIN_LENGTH:
            # The cluster id and the announcements' proofs can be tested offline against
            # guesses: a short secret would be found.
            raise WeakSecret(
                f"the cluster secret must have at least {MIN_LENGTH} characters"
                " (make one with: openssl rand -hex 16)"
            )

    def __repr__(self) -> str:
        return "ClusterSecret(***)"

    @property
    def nats_token(self) -> str:
        return _derive(self.value, "shoal nats token v1").hex()

    @property
    def route_password(self) -> str:
        """What the NATS servers of an HA cluster authenticate their routes with."""
        return _derive(self.value, "shoal nats routes v1").hex()

    @property
    def cluster_id(self) -> str:
        """Public: which announcements are this cluster's."""
        return _derive(self.value, "shoal cluster id v1").hex()[:16]

    def sign(self, message: bytes) -> str:
        key = _derive(self.value, "shoal announcement v1")
        return hmac.new(key, message, hashlib.sha256).hexdigest()

    def verify(self, message: bytes, proof: str) -> bool:
        return hmac.compare_digest(self.sign(message), proof)
