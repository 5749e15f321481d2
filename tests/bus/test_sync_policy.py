"""When an acknowledged publish is on disk: the embedded server's setting, and the warning
about a given server that syncs lazily (read from its real ``/varz``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from bus.embedded import EmbeddedNats, free_port
from bus.sync_policy import (
    SyncSettingError,
    lazy_sync_warning,
    monitor_url,
    sync_setting,
    warn_if_lazy,
)


def test_sync_setting_defaults_to_always_and_takes_durations() -> None:
    assert sync_setting(None) == sync_setting("") == sync_setting(" always ") == "always"
    assert sync_setting("10s") == "10s"
    assert sync_setting("1h30m") == "1h30m"
    for bad in ("never", "10", "2 minutes", "-1s"):
        with pytest.raises(SyncSettingError, match="SHOAL_NATS_SYNC"):
            sync_setting(bad)


def _varz(config: dict[str, Any]) -> dict[str, Any]:
    return {"server_name": "n1", "jetstream": {"config": {"store_dir": "/x", **config}}}


def test_lazy_sync_warning_decides_from_varz() -> None:
    assert lazy_sync_warning(_varz({"sync_interval": 120e9, "sync_always": True})) is None
    warning = lazy_sync_warning(_varz({"sync_interval": 120e9}))  # sync_always left out: off
    assert warning is not None and "every 120 s" in warning and "sync_interval: always" in warning
    assert "n1" in warning
    assert lazy_sync_warning({"server_name": "n1"}) is None  # no JetStream
    assert lazy_sync_warning(_varz({})) is None  # too old to say


def test_monitor_url() -> None:
    assert monitor_url("nats://h1:4222,nats://h2:4222", {}) == "http://h1:8222/varz"
    assert monitor_url("tls://[::1]:4222", {}) == "http://[::1]:8222/varz"
    env = {"SHOAL_NATS_MONITOR": "http://mon:9000/"}
    assert monitor_url("nats://h1:4222", env) == "http://mon:9000/varz"


@pytest.mark.parametrize("sync", ["always", "10s"])
async def test_a_real_server_is_read_and_warned_about(
    tmp_path: Path, sync: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    http = free_port()
    with EmbeddedNats(tmp_path / "nats", sync=sync, config=f"http_port: {http}\n") as srv:
        monkeypatch.setenv("SHOAL_NATS_MONITOR", f"http://127.0.0.1:{http}")
        with caplog.at_level(logging.WARNING, logger="bus.sync_policy"):
            warning = await warn_if_lazy(srv.url)
    if sync == "always":
        assert warning is None and not caplog.records
    else:
        assert warning is not None and "every 10 s" in warning
        assert warning in caplog.text


async def test_an_unreadable_monitor_is_no_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_NATS_MONITOR", f"http://127.0.0.1:{free_port()}")
    assert await warn_if_lazy("nats://127.0.0.1:4222") is None


def test_the_embedded_server_syncs_each_write_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert EmbeddedNats(tmp_path / "a").sync == "always"
    monkeypatch.setenv("SHOAL_NATS_SYNC", "2m")
    assert EmbeddedNats(tmp_path / "b").sync == "2m"
    monkeypatch.setenv("SHOAL_NATS_SYNC", "sometimes")
    with pytest.raises(SyncSettingError):
        EmbeddedNats(tmp_path / "c")
