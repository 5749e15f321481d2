"""Which address a node advertises to the others, and why (``services/worker/address.py``)."""

from __future__ import annotations

from services.addresses import Interfaces, advertised, choose, nats_hosts

LAN = Interfaces({"lo": ["127.0.0.1"], "eth0": ["10.77.0.1"]}, default="eth0")


def test_given_wins() -> None:
    chosen = choose("10.1.2.3", "nats://10.0.0.9:4222", "10.0.0.5", True, LAN)
    assert (chosen.address, chosen.why) == ("10.1.2.3", "given (--data-host)")


def test_a_remote_nats_gives_the_route_s_source() -> None:
    chosen = choose(None, "nats://10.0.0.9:4222", "10.0.0.5", False, LAN)
    assert chosen.address == "10.0.0.5"
    assert "route to NATS at 10.0.0.9" in chosen.why
    # The first server that is not on this machine decides, whatever the order.
    chosen = choose(None, "nats://127.0.0.1:4222,nats://10.0.0.9:4222", "10.0.0.5", True, LAN)
    assert chosen.address == "10.0.0.5"


def test_a_local_nats_open_beyond_loopback_never_gives_loopback() -> None:
    # The defect this fixes: `shoal up --nats-host 0.0.0.0` advertised 127.0.0.1, which the
    # second machine's stages could not reach.
    chosen = choose(None, "nats://127.0.0.1:4222", None, True, LAN)
    assert chosen.address == "10.77.0.1"
    assert "eth0, the default route's interface" in chosen.why
    assert "other machines may join" in chosen.why


def test_without_a_default_route_the_only_lan_address() -> None:
    interfaces = Interfaces({"lo": ["127.0.0.1"], "eth0": ["10.77.0.2"]})
    chosen = choose(None, "nats://127.0.0.1:4222", None, True, interfaces)
    assert chosen.address == "10.77.0.2" and "the only address beyond loopback" in chosen.why
    several = Interfaces({"eth0": ["10.77.0.2"], "eth1": ["192.168.1.5"], "lo": ["127.0.0.1"]})
    chosen = choose(None, "nats://127.0.0.1:4222", None, True, several)
    assert chosen.address == "10.77.0.2"
    assert "192.168.1.5" in chosen.why and "--data-host chooses" in chosen.why


def test_loopback_only_where_no_other_machine_can_join() -> None:
    chosen = choose(None, "nats://127.0.0.1:4222", None, False, LAN)
    assert chosen.address == "127.0.0.1" and "loopback only" in chosen.why
    alone = Interfaces({"lo": ["127.0.0.1"]})
    chosen = choose(None, "nats://127.0.0.1:4222", None, True, alone)
    assert chosen.address == "127.0.0.1" and "cannot reach it" in chosen.why


def test_urls_that_say_little() -> None:
    assert nats_hosts("nats://a:1, nats://b:2") == ["a", "b"]
    assert nats_hosts("nats://") == ["127.0.0.1"]
    assert nats_hosts("not a url") == ["127.0.0.1"]


def test_this_machine() -> None:
    # Loopback NATS and nothing open: the one answer that does not depend on the machine.
    assert advertised(None, "nats://127.0.0.1:4222", False).address == "127.0.0.1"
