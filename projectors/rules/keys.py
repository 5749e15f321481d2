"""API keys: added and revoked."""

from __future__ import annotations

from dataclasses import replace

from events.catalogue import (
    KeyAdded,
    KeyRevoked,
)
from projectors.rows import (
    KeyRow,
)
from projectors.state import Change, ClusterState, Put


def key_added(state: ClusterState, e: KeyAdded) -> list[Change]:
    if state.api_key(e.key_id) is not None:
        return []  # an id is made once: a key revoked stays revoked
    row = KeyRow(
        key_id=e.key_id,
        name=e.name,
        role=e.role,
        digest=e.digest,
        requests_per_minute=e.requests_per_minute,
        tokens_per_minute=e.tokens_per_minute,
        added_at=e.ts,
    )
    return [Put(row)]


def key_revoked(state: ClusterState, e: KeyRevoked) -> list[Change]:
    old = state.api_key(e.key_id)
    if old is None or old.revoked_at is not None:
        return []
    return [Put(replace(old, revoked_at=e.ts))]
