"""The test hosts themselves (``harness/hosts.py``): their own addresses and loopback, and the
faults and limits the multi-machine tests rely on."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.hosts import Network

TWO = pytest.mark.parametrize("hosts", [2], indirect=True)

SERVE = "import socket; s = socket.create_server(('{}', 9000)); s.accept(); print('accepted')"
CONNECT = "import socket; socket.create_connection(('{}', 9000), timeout={})"


def _connects(net: Network, to: str, timeout: float = 2.0) -> bool:
    client = net.hosts[0]
    done = client.run([sys.executable, "-c", CONNECT.format(to, timeout)], timeout=timeout + 10)
    return done.returncode == 0


@TWO
def test_each_host_has_its_address_and_a_loopback_of_its_own(hosts: Network) -> None:
    a, b = hosts.hosts
    assert a.address != b.address and a.address.startswith("10.77.")
    # Each is a network namespace of its own (`ip netns`), not a process on this one's loopback.
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert {a.name, b.name} <= {line.split()[0] for line in namespaces.splitlines() if line}
    b.popen([sys.executable, "-c", SERVE.format("0.0.0.0")], b.dir / "serve.log")
    time.sleep(0.5)
    assert not _connects(hosts, "127.0.0.1")  # b's loopback is b's alone
    assert _connects(hosts, b.address)


@TWO
def test_a_partition_hangs_connections_until_healed(hosts: Network) -> None:
    _, b = hosts.hosts
    b.popen([sys.executable, "-c", SERVE.format(b.address)], b.dir / "serve.log")
    time.sleep(0.5)
    b.partition()
    assert not _connects(hosts, b.address, timeout=1.0)  # no answer at all, as a pulled cable
    b.heal()
    assert _connects(hosts, b.address)


@TWO
def test_pause_freezes_and_kill_ends_every_process_of_a_host(hosts: Network) -> None:
    _, b = hosts.hosts
    ticker = b.popen(
        ["bash", "-c", "while true; do date +%s%N; sleep 0.05; done"], b.dir / "tick.log"
    )
    time.sleep(0.3)
    b.pause()
    frozen = (b.dir / "tick.log").read_text()
    time.sleep(0.5)
    assert (b.dir / "tick.log").read_text() == frozen
    b.resume()
    time.sleep(0.3)
    assert (b.dir / "tick.log").read_text() != frozen
    b.kill()
    assert ticker.poll() is not None and b.pids() == []


@TWO
def test_a_cpu_quota_holds_a_host_to_its_share(hosts: Network) -> None:
    _, b = hosts.hosts
    b.limit_cpu(0.25)
    spin = (
        "import time; t0 = time.time(); c0 = time.process_time()\n"
        "while time.time() - t0 < 1: pass\n"
        "print(time.process_time() - c0)"
    )
    done = b.run([sys.executable, "-c", spin])
    assert float(done.stdout) < 0.45, done.stdout  # a quarter of a core for a second
    b.limit_cpu(None)


def test_namespaces_cannot_be_made_without_root() -> None:
    done = subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            sys.executable,
            "-c",
            "from harness.hosts import check_available; check_available()",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "test hosts need root" in done.stderr
