"""Stream definitions: created at start, a no-op when unchanged, updated when settings change."""

from __future__ import annotations

import logging

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType
from nats.js.errors import NotFoundError

from bus.publisher import Publisher
from bus.stores.object_store import object_stream
from bus.stores.parts import PARTS_STREAM
from bus.streams import (
    CHUNKS_STREAM,
    DAY,
    DEADLETTER_STREAM,
    EVENTS_STREAM,
    MODELS_BUCKET,
    SNAPSHOTS_BUCKET,
    StreamSettings,
    StreamSettingsError,
    ensure_streams,
    parse_duration,
    parse_size,
    stream_configs,
)
from events.catalogue import ChunkGenerated, NodeJoined

ALL_STREAMS = (EVENTS_STREAM, CHUNKS_STREAM, DEADLETTER_STREAM)
# The models bucket's stream, made with them.
BUCKET_STREAM = object_stream(MODELS_BUCKET)
SNAPSHOTS_STREAM = object_stream(SNAPSHOTS_BUCKET)


async def test_creates_the_three_streams_and_the_bucket(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    js = nc.jetstream()
    for name in ALL_STREAMS:
        with pytest.raises(NotFoundError):
            await js.stream_info(name)
    with caplog.at_level(logging.INFO, logger="bus.streams"):
        await ensure_streams(js)
    made = {s.config.name for s in await js.streams_info()}
    assert made == {*ALL_STREAMS, BUCKET_STREAM, SNAPSHOTS_STREAM, PARTS_STREAM}
    assert sum("created stream" in r.getMessage() for r in caplog.records) == 6
    parts = (await js.stream_info(PARTS_STREAM)).config
    assert parts.max_msgs_per_subject == 1 and parts.max_age == 0  # kept as long as events
    # nats-py's own object store client sees it as a bucket.
    status = await (await js.object_store(MODELS_BUCKET)).status()
    assert status.bucket == MODELS_BUCKET and status.replicas == 1


async def test_the_bucket_follows_the_replicas_setting_only(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="bus.streams"):
        await ensure_streams(js, StreamSettings(duplicate_window=300.0))
    updated = [r.getMessage() for r in caplog.records if "updated stream" in r.getMessage()]
    assert f"updated stream {BUCKET_STREAM}" not in updated
    bucket = (await js.stream_info(BUCKET_STREAM)).config
    assert bucket.num_replicas == 1 and bucket.allow_rollup_hdrs and bucket.allow_direct


async def test_events_stream_config(js: JetStreamContext) -> None:
    cfg = (await js.stream_info(EVENTS_STREAM)).config
    assert cfg.subjects == ["shoal.events.>"]
    assert cfg.storage == StorageType.FILE
    assert cfg.retention == RetentionPolicy.LIMITS
    assert cfg.duplicate_window is not None and cfg.duplicate_window >= 120
    assert cfg.max_age == 0  # unlimited by default: the log is the source of truth
    assert cfg.max_bytes == -1
    assert cfg.num_replicas == 1


async def test_chunks_stream_config(js: JetStreamContext) -> None:
    cfg = (await js.stream_info(CHUNKS_STREAM)).config
    assert cfg.subjects == ["shoal.chunks.>"]
    assert cfg.storage == StorageType.FILE
    assert cfg.retention == RetentionPolicy.LIMITS
    assert cfg.max_age == pytest.approx(24 * 3600)
    assert cfg.max_age == pytest.approx(DAY)


async def test_deadletter_stream_config(js: JetStreamContext) -> None:
    cfg = (await js.stream_info(DEADLETTER_STREAM)).config
    assert cfg.subjects == ["shoal.deadletter.>"]
    assert cfg.storage == StorageType.FILE
    assert cfg.retention == RetentionPolicy.LIMITS
    assert cfg.max_age == pytest.approx(30 * DAY)


async def test_streams_take_their_subjects(js: JetStreamContext) -> None:
    """Each subject family lands in its own stream, and nowhere else."""
    pub = Publisher(js)
    ack = await pub.publish(NodeJoined(node_id="n", origin="n"))
    assert ack.stream == EVENTS_STREAM
    ack = await pub.publish(ChunkGenerated(task_id="t", idx=0, text="x", origin="n"))
    assert ack.stream == CHUNKS_STREAM
    ack = await js.publish("shoal.deadletter.SHOAL_EVENTS", b"x")
    assert ack.stream == DEADLETTER_STREAM
    for name in ALL_STREAMS:
        assert (await js.stream_info(name)).state.messages == 1


async def test_second_call_is_a_noop(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    await Publisher(js).publish(NodeJoined(node_id="n", origin="n"))
    before = {name: await js.stream_info(name) for name in ALL_STREAMS}
    with caplog.at_level(logging.INFO, logger="bus.streams"):
        await ensure_streams(js)
        await ensure_streams(js, StreamSettings())
    assert not [r for r in caplog.records if r.name == "bus.streams"]
    for name in ALL_STREAMS:
        after = await js.stream_info(name)
        assert after.created == before[name].created
        assert after.config == before[name].config
        assert after.state.messages == before[name].state.messages
    assert len(await js.streams_info()) == 6  # with the buckets and the parts


async def test_changed_settings_update_the_streams(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    await Publisher(js).publish(NodeJoined(node_id="n", origin="n"))
    created = (await js.stream_info(EVENTS_STREAM)).created
    settings = StreamSettings(
        events_max_age=30 * DAY,
        events_max_bytes=512 * 1024**2,
        chunks_max_age=2 * 3600.0,
        duplicate_window=300.0,
    )
    with caplog.at_level(logging.INFO, logger="bus.streams"):
        await ensure_streams(js, settings)
    updated = sorted(r.getMessage() for r in caplog.records if "updated stream" in r.getMessage())
    # The window changed all; the parts follow the events' age.
    assert updated == [f"updated stream {n}" for n in sorted([*ALL_STREAMS, PARTS_STREAM])]
    parts = await js.stream_info(PARTS_STREAM)
    assert parts.config.max_age == pytest.approx(45 * DAY)  # half again the events'

    events = await js.stream_info(EVENTS_STREAM)
    assert events.config.max_age == pytest.approx(30 * DAY)
    assert events.config.max_bytes == 512 * 1024**2
    assert events.config.duplicate_window == pytest.approx(300.0)
    assert events.created == created  # updated in place, not recreated
    assert events.state.messages == 1  # nothing lost
    chunks = await js.stream_info(CHUNKS_STREAM)
    assert chunks.config.max_age == pytest.approx(2 * 3600.0)

    # And the same settings again change nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bus.streams"):
        await ensure_streams(js, settings)
    assert not [r for r in caplog.records if r.name == "bus.streams"]


async def test_only_the_changed_stream_is_updated(
    js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="bus.streams"):
        await ensure_streams(js, StreamSettings(events_max_age=7 * DAY))
    messages = [r.getMessage() for r in caplog.records if r.name == "bus.streams"]
    # And the parts, which the events name: kept half again as long.
    assert messages == [f"updated stream {EVENTS_STREAM}", f"updated stream {PARTS_STREAM}"]
    assert (await js.stream_info(PARTS_STREAM)).config.max_age == pytest.approx(10.5 * DAY)
    assert (await js.stream_info(EVENTS_STREAM)).config.max_age == pytest.approx(7 * DAY)
    assert (await js.stream_info(CHUNKS_STREAM)).config.max_age == pytest.approx(DAY)


async def test_going_back_to_defaults_updates_again(js: JetStreamContext) -> None:
    await ensure_streams(js, StreamSettings(events_max_bytes=10**9))
    assert (await js.stream_info(EVENTS_STREAM)).config.max_bytes == 10**9
    await ensure_streams(js, StreamSettings())  # the defaults, given explicitly
    assert (await js.stream_info(EVENTS_STREAM)).config.max_bytes == -1


async def test_a_deleted_stream_is_recreated(js: JetStreamContext) -> None:
    await js.delete_stream(CHUNKS_STREAM)
    await ensure_streams(js)
    assert (await js.stream_info(CHUNKS_STREAM)).config.subjects == ["shoal.chunks.>"]


def test_stream_configs_follow_settings() -> None:
    configs = {c.name: c for c in stream_configs(StreamSettings(replicas=3, duplicate_window=150))}
    assert set(configs) == set(ALL_STREAMS)
    for c in configs.values():
        assert c.num_replicas == 3
        assert c.duplicate_window == 150
        assert c.storage == StorageType.FILE
        assert c.retention == RetentionPolicy.LIMITS


async def test_short_max_age_is_accepted(js: JetStreamContext) -> None:
    await ensure_streams(js, StreamSettings(chunks_max_age=60.0))
    assert (await js.stream_info(CHUNKS_STREAM)).config.max_age == pytest.approx(60.0)


def test_durations_and_sizes_parse() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "24h", "30d", "0")] == [
        90.0,
        90.0,
        900.0,
        86400.0,
        30 * DAY,
        0.0,
    ]
    assert [parse_size(t) for t in ("1000", "512M", "10G", "1GiB", "2k", "-1")] == [
        1000,
        512 * 1024**2,
        10 * 1024**3,
        1024**3,
        2048,
        -1,
    ]
    for bad in ("soon", "-5s", ""):
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError):
        parse_size("lots")


def test_settings_from_env() -> None:
    assert StreamSettings.from_env({}) is None
    assert StreamSettings.from_env(
        {
            "SHOAL_EVENTS_MAX_AGE": "30d",
            "SHOAL_STREAM_REPLICAS": "3",
            "SHOAL_EVENTS_MAX_BYTES": "10G",
        }
    ) == StreamSettings(events_max_age=30 * DAY, events_max_bytes=10 * 1024**3, replicas=3)
    with pytest.raises(StreamSettingsError, match="SHOAL_CHUNKS_MAX_AGE"):
        StreamSettings.from_env({"SHOAL_CHUNKS_MAX_AGE": "tomorrow"})


async def test_without_settings_an_existing_stream_is_left_alone(js: JetStreamContext) -> None:
    """A process started without stream settings (say a worker on another machine) must not
    undo what the operator configured."""
    await ensure_streams(js, StreamSettings(events_max_age=7 * DAY))
    await ensure_streams(js)
    info = await js.stream_info(EVENTS_STREAM)
    assert info.config.max_age == 7 * DAY
