"""When JetStream's acknowledgement of a publish means the event is on disk.

A nats-server acknowledges a publish once the message is in its store's write buffer, and by
default writes that buffer to disk every two minutes (``sync_interval``): a power cut or a
kernel crash loses what was acknowledged meanwhile (Jepsen, NATS 2.12.1). Shoal's embedded
server syncs every write before its acknowledgement (``sync_interval: always``), unless
``SHOAL_NATS_SYNC`` says otherwise; a server Shoal is only given is read at start (its
monitoring endpoint's ``/varz``) and a lazy one is warned about (docs/operations.md, "Power cuts
and crashes").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

SYNC_ENV = "SHOAL_NATS_SYNC"
DEFAULT_SYNC = "always"
# Where a given server's monitoring endpoint is (``http://host:8222``); by default its host's
# port 8222, nats-server's usual monitoring port.
MONITOR_ENV = "SHOAL_NATS_MONITOR"
MONITOR_PORT = 8222
MONITOR_TIMEOUT_S = 2.0

# A Go duration as nats-server reads it: "always", or "10s", "500ms", "2m", "1h30m".
_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


class SyncSettingError(ValueError):
    pass


def sync_setting(value: str | None) -> str:
    """The embedded server's ``sync_interval``: ``always`` (the default, unset or empty) or a
    duration such as ``2m`` (nats-server's own default, lazy)."""
    value = (value or "").strip() or DEFAULT_SYNC
    if value != "always" and not _DURATION.match(value):
        raise SyncSettingError(
            f"{SYNC_ENV}={value!r}: give 'always' (sync each write before its ack) or a"
            " duration such as '10s' or '2m'"
        )
    return value


def embedded_sync() -> str:
    """``sync_setting`` from the environment."""
    return sync_setting(os.environ.get(SYNC_ENV))


def lazy_sync_warning(varz: Mapping[str, Any]) -> str | None:
    """From a nats-server's ``/varz``: a warning when its JetStream acknowledges writes it has
    not synced to disk, or None (it syncs each write, or runs no JetStream, or is too old to
    say). The server leaves ``sync_always`` out when it is off, and says ``sync_interval``."""
    config = (varz.get("jetstream") or {}).get("config") or {}
    if config.get("sync_always") or "sync_interval" not in config:
        return None
    interval_s = float(config.get("sync_interval") or 0) / 1e9
    every = f"every {interval_s:g} s" if interval_s > 0 else "on its own schedule"
    name = varz.get("server_name") or varz.get("server_id") or "the nats-server"
    return (
        f"{name} acknowledges JetStream writes before they are on disk (it syncs {every}): a"
        " power cut or kernel crash there can lose acknowledged events. Set"
        " `jetstream { sync_interval: always }` in its configuration (docs/operations.md,"
        " 'Power cuts and crashes')."
    )


def monitor_url(nats_url: str, env: Mapping[str, str] | None = None) -> str:
    """Where the server's ``/varz`` is: ``SHOAL_NATS_MONITOR``, else port 8222 of the first
    server of ``nats_url``."""
    env = os.environ if env is None else env
    if given := env.get(MONITOR_ENV, "").strip():
        return given.rstrip("/") + "/varz"
    host = urlsplit(nats_url.split(",")[0].strip()).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{MONITOR_PORT}/varz"


def _read_varz(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=MONITOR_TIMEOUT_S) as r:
        varz = json.loads(r.read())
    if not isinstance(varz, dict):
        raise ValueError("not a /varz answer")
    return varz


async def warn_if_lazy(nats_url: str) -> str | None:
    """At the start of a service given a nats-server: read its ``/varz`` and log a warning when
    it syncs lazily (returned too). A server whose monitoring endpoint cannot be read is only
    mentioned at info level: nothing can be said of it."""
    url = monitor_url(nats_url)
    if not url.startswith(("http://", "https://")):
        return None
    try:
        varz = await asyncio.to_thread(_read_varz, url)
    except (OSError, ValueError) as exc:
        log.info(
            "could not read %s (%s): whether NATS syncs each write to disk is unknown (see"
            " docs/operations.md, 'Power cuts and crashes'; %s names its monitoring endpoint)",
            url,
            exc,
            MONITOR_ENV,
        )
        return None
    warning = lazy_sync_warning(varz)
    if warning is not None:
        log.warning("%s", warning)
    return warning
