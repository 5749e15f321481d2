"""Where a node's pipeline stages listen by default: the address it reaches NATS from."""

from __future__ import annotations

from services.worker.worker import data_host_towards


def test_a_local_nats_means_loopback() -> None:
    assert data_host_towards("nats://127.0.0.1:4222") == "127.0.0.1"
    assert data_host_towards("nats://127.0.0.3:4222,nats://10.0.0.9:4222") == "127.0.0.1"


def test_an_unroutable_address_falls_back_to_loopback() -> None:
    assert data_host_towards("nats://") == "127.0.0.1"
    assert data_host_towards("not a url") == "127.0.0.1"
