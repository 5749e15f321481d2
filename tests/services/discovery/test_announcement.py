"""Announcements: recognised by the cluster of the secret, proven with it, useless without it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bus.cluster_secret import ClusterSecret, WeakSecret
from bus.nats_security import NatsSecurity, NatsSecurityError
from services.discovery.announcement import MAX_URLS, Announcement, announcement

SECRET = ClusterSecret("a" * 32)
OTHER = ClusterSecret("b" * 32)


def _ours() -> Announcement:
    return announcement(SECRET, "node-a", ["nats://10.77.0.1:4222"], "http://10.77.0.1:8000", "1")


def test_an_announcement_is_proven_by_its_secret_only() -> None:
    ours = _ours()
    assert ours.proven_by(SECRET)
    assert not ours.proven_by(OTHER)
    # Pointing the same proof elsewhere fails it.
    assert not replace(ours, nats_urls=("nats://10.9.9.9:4222",)).proven_by(SECRET)
    # Another cluster's announcement, signed with its own secret, is not ours.
    assert not announcement(OTHER, "x", ["nats://10.77.0.5:4222"], "", "1").proven_by(SECRET)


def test_it_carries_no_secret() -> None:
    text = repr(_ours().properties())
    for derived in (SECRET.value, SECRET.nats_token):
        assert derived not in text
    assert SECRET.cluster_id in text
    assert repr(SECRET) == "ClusterSecret(***)"


def test_properties_round_trip_and_others_are_ignored() -> None:
    ours = _ours()
    props = {k.encode(): v.encode() for k, v in ours.properties().items()}
    assert Announcement.from_properties(props) == ours
    assert Announcement.from_properties({b"path": b"/"}) is None
    many = announcement(SECRET, "n", [f"nats://10.0.0.{i}:4222" for i in range(9)], "", "1")
    assert len(many.nats_urls) == MAX_URLS and many.proven_by(SECRET)


def test_the_secret_derives_the_nats_token_and_is_long_enough() -> None:
    security = NatsSecurity.from_env({"SHOAL_CLUSTER_SECRET": SECRET.value})
    assert security.token is not None
    assert security.token.get_secret_value() == SECRET.nats_token != SECRET.value
    explicit = NatsSecurity.from_env(
        {"SHOAL_CLUSTER_SECRET": SECRET.value, "SHOAL_NATS_TOKEN": "t"}
    )
    assert explicit.token is not None and explicit.token.get_secret_value() == "t"
    with pytest.raises(WeakSecret):
        ClusterSecret("short")
    with pytest.raises(NatsSecurityError, match="at least 16"):
        NatsSecurity.from_env({"SHOAL_CLUSTER_SECRET": "short"})
