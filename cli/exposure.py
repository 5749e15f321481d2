"""Refusing to listen where others can reach what is left open: `shoal up` and `shoal api`."""

from __future__ import annotations

from bus.nats_security import NatsSecurity
from services.addresses import is_loopback


def refuse_exposure(
    api_host: str, nats_host: str | None, keys: frozenset[str], security: NatsSecurity | None
) -> str | None:
    """Why a process must not listen where others can reach it, or None. Beyond loopback,
    the API needs keys and NATS needs authentication: either open would hand the cluster (and
    every prompt) to whoever can reach the port. ``nats_host`` and ``security``: the NATS
    server this process runs (`shoal up`'s); None for an API alone (`shoal api`)."""
    missing = []
    beyond = [h for h in (api_host, nats_host) if h is not None and not is_loopback(h)]
    if beyond and not keys:
        missing.append("API keys (--api-key-file or SHOAL_API_KEYS)")
    if beyond and security is not None and not security.authenticates:
        missing.append(
            "NATS authentication (--nats-token-file or SHOAL_NATS_TOKEN, --nats-user with"
            " --nats-password-file, or --nats-nkey)"
        )
    if not missing:
        return None
    return f"refusing to listen on {', '.join(sorted(set(beyond)))} without " + " and ".join(
        missing
    )
