"""What an API process is told at start: where NATS and the projection are, and who may call it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from projectors.projector import DEFAULT_NAME


@dataclass(frozen=True)
class ApiConfig:
    nats_url: str
    db_url: str
    # Bearer keys; empty: no authentication (the API binds to 127.0.0.1 unless told otherwise).
    api_keys: frozenset[str] = frozenset()
    projector: str = DEFAULT_NAME
    # How long a request may wait for its task to finish (queueing included).
    task_timeout_s: float = 600.0
    # How long a model found able to serve is taken to still be (api/serving_verdicts.py).
    serving_ttl_s: float = 1.0


def keys_from_env(value: str | None = None) -> frozenset[str]:
    """``SHOAL_API_KEYS``: keys separated by commas or whitespace."""
    text = os.environ.get("SHOAL_API_KEYS", "") if value is None else value
    return frozenset(k for k in text.replace(",", " ").split() if k)
