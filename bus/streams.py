"""JetStream stream definitions, created or updated idempotently at start."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from bus.subjects import CHUNKS_PREFIX, DEADLETTER_PREFIX, EVENTS_PREFIX

log = logging.getLogger(__name__)

EVENTS_STREAM = "SHOAL_EVENTS"
CHUNKS_STREAM = "SHOAL_CHUNKS"
DEADLETTER_STREAM = "SHOAL_DEADLETTER"

DAY = 24 * 3600.0


@dataclass(frozen=True)
class StreamSettings:
    """What an operator may tune. Zero/-1 mean unlimited, as in JetStream."""

    events_max_age: float = 0.0
    events_max_bytes: int = -1
    chunks_max_age: float = DAY
    chunks_max_bytes: int = -1
    deadletter_max_age: float = 30 * DAY
    duplicate_window: float = 120.0
    replicas: int = 1


def stream_configs(settings: StreamSettings) -> list[StreamConfig]:
    def limits(name: str, prefix: str, max_age: float, max_bytes: int) -> StreamConfig:
        return StreamConfig(
            name=name,
            subjects=[f"{prefix}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=max_age,
            max_bytes=max_bytes,
            # JetStream refuses a duplicate window longer than the max age.
            duplicate_window=min(settings.duplicate_window, max_age)
            if max_age > 0
            else settings.duplicate_window,
            num_replicas=settings.replicas,
        )

    return [
        limits(EVENTS_STREAM, EVENTS_PREFIX, settings.events_max_age, settings.events_max_bytes),
        limits(CHUNKS_STREAM, CHUNKS_PREFIX, settings.chunks_max_age, settings.chunks_max_bytes),
        limits(DEADLETTER_STREAM, DEADLETTER_PREFIX, settings.deadletter_max_age, -1),
    ]


_COMPARED = ("subjects", "max_age", "max_bytes", "duplicate_window", "num_replicas")


async def ensure_streams(js: JetStreamContext, settings: StreamSettings | None = None) -> None:
    """Create the streams, or update them where the settings changed. Safe to call from every
    process at every start."""
    for wanted in stream_configs(settings or StreamSettings()):
        assert wanted.name is not None
        try:
            current = (await js.stream_info(wanted.name)).config
        except NotFoundError:
            await js.add_stream(wanted)
            log.info("created stream %s", wanted.name)
            continue
        if any(getattr(current, f) != getattr(wanted, f) for f in _COMPARED):
            await js.update_stream(wanted)
            log.info("updated stream %s", wanted.name)
