"""Importing nats-py without its WebSocket transport.

nats-py imports aiohttp as it is imported, for ``ws://`` URLs, which Shoal never uses (it
connects with ``nats://`` and ``tls://``): CPU time at the start of every process, a runner's
included, which is on a cold model's time to first token. The `shoal` command imports nats-py
this way first; aiohttp stays importable for anything else that wants it.
"""

from __future__ import annotations

import sys


def import_nats_without_websockets() -> None:
    """Import nats-py, with its WebSocket transport left out (unless aiohttp or nats-py is
    imported already: then there is nothing to save)."""
    if "nats" in sys.modules or "aiohttp" in sys.modules:
        return
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # an ImportError for nats-py
    try:
        import nats.aio.client  # noqa: F401
    finally:
        del sys.modules["aiohttp"]
