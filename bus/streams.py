"""JetStream stream definitions, created or updated idempotently at start."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from bus.stores.object_store import bucket_config
from bus.stores.parts import parts_config, parts_max_age
from events.subjects import CHUNKS_PREFIX, DEADLETTER_PREFIX, EVENTS_PREFIX

log = logging.getLogger(__name__)

EVENTS_STREAM = "SHOAL_EVENTS"
CHUNKS_STREAM = "SHOAL_CHUNKS"
DEADLETTER_STREAM = "SHOAL_DEADLETTER"
# The object store bucket that holds model weights, replicated as the streams are (its stream
# is OBJ_SHOAL_MODELS; bus/stores/object_store.py has the layout).
MODELS_BUCKET = "SHOAL_MODELS"
# Snapshots of the projection (projectors/snapshot.py), so that old events may age out.
SNAPSHOTS_BUCKET = "SHOAL_SNAPSHOTS"

DAY = 24 * 3600.0


class StreamSettingsError(ValueError):
    pass


@dataclass(frozen=True)
class StreamSettings:
    """What an operator may tune. Zero/-1 mean unlimited, as in JetStream. Durations are
    seconds."""

    events_max_age: float = 0.0
    events_max_bytes: int = -1
    chunks_max_age: float = DAY
    chunks_max_bytes: int = -1
    deadletter_max_age: float = 30 * DAY
    duplicate_window: float = 120.0
    replicas: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> StreamSettings | None:
        """Settings from ``SHOAL_EVENTS_MAX_AGE``, ``SHOAL_EVENTS_MAX_BYTES``,
        ``SHOAL_CHUNKS_MAX_AGE``, ``SHOAL_CHUNKS_MAX_BYTES``, ``SHOAL_DEADLETTER_MAX_AGE``,
        ``SHOAL_DUPLICATE_WINDOW`` and ``SHOAL_STREAM_REPLICAS``; None when none is set, so a
        process started without them leaves the streams as the operator configured them."""
        values: dict[str, float | int] = {}
        for f in fields(cls):
            raw = env.get(f"SHOAL_{f.name.upper()}")
            if f.name == "replicas":
                raw = env.get("SHOAL_STREAM_REPLICAS")
            if raw is None or not raw.strip():
                continue
            try:
                if f.name.endswith("bytes"):
                    values[f.name] = parse_size(raw)
                elif f.name == "replicas":
                    values[f.name] = int(raw)
                else:
                    values[f.name] = parse_duration(raw)
            except ValueError as exc:
                raise StreamSettingsError(f"SHOAL_{f.name.upper()}={raw!r}: {exc}") from exc
        return cls(**values) if values else None  # type: ignore[arg-type]


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY}
_SIZE_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '24h', '30d' -> seconds; '0' means unlimited."""
    t = text.strip().lower()
    unit = _DURATION_UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError("expected seconds or a number with s, m, h or d") from None
    if value < 0:
        raise ValueError("a duration cannot be negative")
    return value


def parse_size(text: str) -> int:
    """'1000', '512M', '10G' (binary units) -> bytes; '-1' means unlimited."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = _SIZE_UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    try:
        value = int(float(number) * (unit or 1))
    except ValueError:
        raise ValueError("expected bytes or a number with K, M, G or T") from None
    if value < -1:
        raise ValueError("a size is -1 (unlimited) or more")
    return value


# Each stream and what its subjects start with.
STREAM_PREFIXES = {
    EVENTS_STREAM: EVENTS_PREFIX,
    CHUNKS_STREAM: CHUNKS_PREFIX,
    DEADLETTER_STREAM: DEADLETTER_PREFIX,
}


def all_subjects(stream: str) -> str:
    """The filter that matches everything on a stream."""
    return f"{STREAM_PREFIXES[stream]}.>"


def stream_of(subject: str) -> str | None:
    """The stream that holds a subject (or the subjects a filter matches), or None."""
    for stream, prefix in STREAM_PREFIXES.items():
        if subject.startswith(f"{prefix}."):
            return stream
    return None


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


_COMPARED: tuple[str, ...] = (
    "subjects",
    "max_age",
    "max_bytes",
    "duplicate_window",
    "num_replicas",
)
# A bucket's stream follows the settings in its replicas only (it keeps files, not a log).
_BUCKET_COMPARED: tuple[str, ...] = ("subjects", "num_replicas")
# The parts' stream follows the events' age limit (bus/stores/parts.py).
_PARTS_COMPARED: tuple[str, ...] = ("subjects", "max_age", "num_replicas")


async def renewal(js: JetStreamContext) -> float:
    """After how long a process stores again a prompt part it names (``PartStore``): half the
    events' age limit, 0 when events are kept forever (or the stream is not made yet)."""
    try:
        return ((await js.stream_info(EVENTS_STREAM)).config.max_age or 0.0) / 2
    except NotFoundError:
        return 0.0


async def ensure_streams(js: JetStreamContext, settings: StreamSettings | None = None) -> None:
    """Create missing streams and the models bucket (with ``settings``, or the defaults).
    Given ``settings``, also update existing ones that differ; without, leave them as they
    are. Safe to call from every process at every start."""
    chosen = settings or StreamSettings()
    wanted_all = [(c, _COMPARED) for c in stream_configs(chosen)]
    wanted_all.append((bucket_config(MODELS_BUCKET, chosen.replicas), _BUCKET_COMPARED))
    wanted_all.append((bucket_config(SNAPSHOTS_BUCKET, chosen.replicas), _BUCKET_COMPARED))
    parts = parts_config(parts_max_age(chosen.events_max_age), chosen.replicas)
    wanted_all.append((parts, _PARTS_COMPARED))
    for wanted, compared in wanted_all:
        assert wanted.name is not None
        try:
            current = (await js.stream_info(wanted.name)).config
        except NotFoundError:
            await js.add_stream(wanted)
            log.info("created stream %s", wanted.name)
            continue
        if settings is not None and any(
            getattr(current, f) != getattr(wanted, f) for f in compared
        ):
            await js.update_stream(wanted)
            log.info("updated stream %s", wanted.name)
