"""Which Host and Origin a request may come with (api/hosts.py): the pure rules."""

from __future__ import annotations

import socket

import pytest

from api.hosts import (
    HostPolicy,
    RecentAddresses,
    host_allowed,
    host_policy,
    machine_names,
    origin_allowed,
    parse_host,
    same_origin,
)
from services.addresses import is_loopback, is_wildcard, normal_host

NAMES = frozenset({"mybox", "mybox.local", "mybox.lan"})


def _names() -> frozenset[str]:
    return NAMES


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        ("example.com", ("example.com", None)),
        ("Example.COM.:8000", ("example.com", 8000)),
        ("127.0.0.1:8000", ("127.0.0.1", 8000)),
        ("[::1]:8000", ("::1", 8000)),
        ("[::1]", ("::1", None)),
        ("[0:0:0:0:0:0:0:1]", ("::1", None)),
        ("::1", ("::1", None)),  # bare, as no browser sends it: still the address
        ("example.com:", None),
        ("example.com:http", None),
        ("example.com:99999", None),
        ("[::1", None),
        ("[::1]x", None),
        ("", None),
        ("user@example.com", None),
        ("example.com/path", None),
        ("exämple.com", None),
        ("example.com:٨٠", None),  # digits, but not ASCII ones
    ],
)
def test_parse_host(header: str, parsed: tuple[str, int | None] | None) -> None:
    assert parse_host(header) == parsed


def test_loopback_and_wildcard_addresses() -> None:
    for host in ("localhost", "LOCALHOST.", "127.0.0.1", "127.1.2.3", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.12", "mybox", "localhost.example.com", ""):
        assert not is_loopback(host), host
    for host in ("0.0.0.0", "::", "[::]", ""):
        assert is_wildcard(host), host
    for host in ("127.0.0.1", "192.168.1.12", "mybox"):
        assert not is_wildcard(host), host
    assert normal_host("FE80::0001%eth0") == "fe80::1"


def test_machine_names_are_the_host_name_its_label_and_mdns() -> None:
    assert machine_names("MyBox.lan.") == {"mybox.lan", "mybox", "mybox.local"}
    assert machine_names("mybox") == {"mybox", "mybox.local"}
    assert machine_names("10.0.0.5") == frozenset()
    assert machine_names() == machine_names(socket.gethostname())


def test_on_loopback_only_loopback_names_and_given_ones() -> None:
    policy = host_policy(["127.0.0.1"], ["shoal.example"], names=_names)
    for host in (
        "localhost:8000",
        "127.0.0.1:8000",
        "127.0.0.1",
        "[::1]:8000",
        "127.0.0.2:8000",
        "shoal.example:8000",
        "SHOAL.example.",
    ):
        assert host_allowed(host, policy), host
    for host in ("evil.example:8000", "mybox:8000", "192.168.1.12:8000", "localhost.evil.example"):
        assert not host_allowed(host, policy), host
    assert host_allowed(None, policy)  # HTTP/1.0: no browser's
    assert not host_allowed("", policy)
    assert not host_allowed("evil.example:8000:1", policy)


def test_on_one_address_that_address_and_the_machine_names() -> None:
    policy = host_policy(["192.168.1.12"], names=_names)
    for host in ("192.168.1.12:8000", "mybox:8000", "mybox.local:8000", "localhost:8000"):
        assert host_allowed(host, policy), host
    for host in ("192.168.1.13:8000", "evil.example", "10.0.0.5"):
        assert not host_allowed(host, policy), host
    assert policy.addresses is None  # it listens on one: no other address reaches it


def test_on_every_address_the_machine_addresses_read_again_when_new() -> None:
    reads: list[float] = []
    now = [0.0]
    current = {"192.168.1.12", "fe80::1"}

    def read() -> frozenset[str]:
        reads.append(now[0])
        return frozenset(current)

    addresses = RecentAddresses(read, ttl_s=10.0, clock=lambda: now[0])
    policy = host_policy(["0.0.0.0"], names=_names, addresses=addresses)
    assert host_allowed("192.168.1.12:8000", policy)
    assert host_allowed("[fe80::1]:8000", policy)
    assert host_allowed("mybox:8000", policy)
    assert not host_allowed("evil.example:8000", policy)
    assert len(reads) == 1
    current.add("10.0.0.7")  # DHCP gave another address
    assert not host_allowed("10.0.0.7:8000", policy)  # read a moment ago: not again
    now[0] = 11.0
    assert host_allowed("10.0.0.7:8000", policy)
    assert len(reads) == 2
    assert not host_allowed("10.0.0.8:8000", policy)  # a miss reads at most once per ttl
    assert len(reads) == 2


def test_the_real_interfaces_include_loopback() -> None:
    policy = host_policy(["0.0.0.0"])
    assert policy.addresses is not None and "127.0.0.1" in policy.addresses()


def test_a_star_allows_any_host() -> None:
    policy = host_policy(["127.0.0.1"], ["*"])
    assert policy.any_host and host_allowed("anything.example:1", policy)
    assert host_allowed("not a host", policy)


def test_the_refusal_names_no_address_of_the_machine() -> None:
    policy = host_policy(["0.0.0.0"], ["shoal.example"], names=_names)
    text = policy.describe()
    assert "mybox" not in text and "shoal.example" not in text
    assert "--allowed-host" in text and "this machine's names and addresses" in text
    assert "loopback" in HostPolicy().describe()
    loopback = host_policy(["127.0.0.1"], ["shoal.example"], names=_names).describe()
    assert "this machine" not in loopback and "listens on" not in loopback
    lan = host_policy(["192.168.1.12"], names=_names).describe()
    assert "the address it listens on and this machine's names" in lan


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("http://LOCALHOST:8000", "localhost:8000", True),
        ("http://[::1]:8000", "[::1]:8000", True),
        ("https://shoal.example", "shoal.example", True),
        ("https://shoal.example", "shoal.example:443", True),
        ("http://shoal.example:80", "shoal.example", True),
        ("http://127.0.0.1:8000", "127.0.0.1:9000", False),
        ("http://localhost:8000", "127.0.0.1:8000", False),  # another origin, to a browser
        ("http://evil.example:8000", "127.0.0.1:8000", False),
        ("https://shoal.example", "shoal.example:80", False),
        ("null", "127.0.0.1:8000", False),
        ("file://", "127.0.0.1:8000", False),
        ("http://127.0.0.1:8000/path", "127.0.0.1:8000", False),
        ("http://user@127.0.0.1:8000", "127.0.0.1:8000", False),
        ("http://127.0.0.1:8000", None, False),
        ("http://[::1", "[::1]:8000", False),
    ],
)
def test_same_origin(origin: str, host: str | None, same: bool) -> None:
    assert same_origin(origin, host) is same


def test_origin_allowed() -> None:
    host = "127.0.0.1:8000"
    assert origin_allowed(None, host, ())  # SDKs, curl, servers
    assert origin_allowed("http://127.0.0.1:8000", host, ())  # the dashboard
    assert not origin_allowed("https://evil.example", host, ())
    assert not origin_allowed("null", host, ())
    cors = ("https://app.example",)
    assert origin_allowed("https://app.example", host, cors)
    assert not origin_allowed("https://app.example:444", host, cors)  # exact, as CORS
    assert origin_allowed("https://evil.example", host, ("*",))
