"""The token of a `shoal up` with API keys (bus/local_token.py): kept 0600 in the data
directory, the same at every start, found by this user's commands for a loopback URL only."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus import local_token


def test_the_token_is_private_stable_and_found_for_its_loopback_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    nats_dir = tmp_path / "data" / "nats"
    token = local_token.data_token(nats_dir)
    assert len(token) >= 40 and local_token.data_token(nats_dir) == token
    assert (nats_dir / "token").stat().st_mode & 0o777 == 0o600
    assert local_token.registered("nats://127.0.0.1:4555") is None
    path = local_token.register(4555, token)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert local_token.registered("nats://127.0.0.1:4555") == token
    assert local_token.registered("nats://localhost:4555") == token
    assert local_token.registered("nats://10.0.0.2:4555") is None  # another machine's
    assert local_token.registered("nats://127.0.0.1:4555,nats://10.0.0.2:4222") is None
    assert local_token.registered("nats://127.0.0.1:4556") is None
    local_token.unregister(4555)
    assert local_token.registered("nats://127.0.0.1:4555") is None
