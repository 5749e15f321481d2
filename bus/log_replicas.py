"""How many servers hold the log, and how many more it can lose: for a NATS cluster whose
streams are replicated (``SHOAL_STREAM_REPLICAS``, `shoal up --ha`).

A replicated stream stores a message once a majority of its replicas has it: three replicas
survive the loss of one; with two of three left one more loss stops every write (no quorum).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import APIError

from bus.streams import EVENTS_STREAM, StreamSettings, ensure_streams

log = logging.getLogger(__name__)

# JetStream's "insufficient resources": fewer servers than the replicas asked for.
INSUFFICIENT_RESOURCES = 10023
WATCH_S = 5.0


def tolerance(replicas: int, up: int) -> str:
    """What a stream of ``replicas`` replicas, ``up`` of them current, tolerates (pure)."""
    quorum = replicas // 2 + 1
    spare = up - quorum
    held = f"the log is on {replicas} servers, {up} up"
    if spare < 0:
        return f"{held}: no quorum, nothing can be stored until {quorum - up} more come back"
    if spare == 0:
        return f"{held}: one more loss stops it (no quorum)"
    return f"{held}: it survives the loss of {spare} more"


async def replicas_up(js: JetStreamContext, stream: str = EVENTS_STREAM) -> tuple[int, int]:
    """The stream's replicas, and how many are current (its leader counted)."""
    info = await js.stream_info(stream)
    peers = info.cluster.replicas if info.cluster is not None else None
    others = list(peers or [])
    current = sum(1 for p in others if p.current and not p.offline)
    return 1 + len(others), (1 if info.cluster and info.cluster.leader else 0) + current


async def wait_for_servers(
    js: JetStreamContext, settings: StreamSettings, say: Callable[[str], None]
) -> None:
    """Until the streams exist with ``settings``' replicas: the cluster has a meta leader (two
    servers up) and as many servers as replicas. Says what it waits for, every 10 s."""
    said = 0.0
    loop = asyncio.get_running_loop()
    while True:
        try:
            await ensure_streams(js, settings)
            return
        except APIError as exc:
            if exc.err_code != INSUFFICIENT_RESOURCES:
                raise
            waiting = f"NATS: waiting for {settings.replicas} servers to hold the log"
        except (nats.errors.Error, TimeoutError):
            waiting = "NATS: waiting for a second server (JetStream needs a majority to start)"
        if loop.time() - said > 10:
            say(f"{waiting} (`shoal up --ha` on other machines, with the same secret)")
            said = loop.time()
        await asyncio.sleep(1.0)


async def watch(js: JetStreamContext, stop: asyncio.Event) -> None:
    """Log what the log tolerates, when it changes (a server lost, or back)."""
    last = ""
    while not stop.is_set():
        try:
            now = tolerance(*await replicas_up(js))
        except (nats.errors.Error, TimeoutError, APIError):
            now = "the log's stream does not answer (no leader): an election, or no quorum"
        if now != last:
            log.warning("NATS cluster: %s", now)
            last = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), WATCH_S)
