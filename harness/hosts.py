"""Test hosts: several machines on this one, each with its own address.

A ``Network`` is a Linux bridge with one network namespace per host, joined to it by a veth
pair: host ``i`` has ``eth0`` at ``10.77.<net>.<i + 1>/24`` and its own loopback, so what one
host listens for on 127.0.0.1 the others cannot reach, exactly as on separate machines. The
bridge itself has ``.254``: the test (in the root namespace) reaches every host through it.
No host has a default route, so nothing a test starts can send traffic beyond the bridge; a
multicast route on ``eth0`` lets discovery's announcements pass, as on a LAN.

Each host also has cgroups (v1) of its own: ``cpu`` (``cpus``: a CFS quota, one host a share of
the machine), ``memory`` (``memory``: a limit) and ``freezer`` (``pause``: SIGSTOP for every
process of the host at once, new ones included). Every process started on a host goes into
them, so ``kill`` reaches all it started (a worker's runners too), whatever their sessions.

Faults of a real network: ``partition`` sets the host's link down (its connections hang, no
RST, as when a cable is pulled) and ``heal`` up again; ``pause``/``resume`` freeze its
processes; ``kill`` SIGKILLs them all (the machine dies). ``shape`` limits a link's bandwidth
with ``tc ... tbf``. This kernel has no ``netem``: a test that needs latency puts a delaying
relay in front of a port (none does yet).

Making namespaces needs root and iproute2: without them ``Network`` raises ``HostsUnavailable``
saying why, and the tests that need hosts fail (they are not skipped: CI runs as root).

Networks are numbered under a lock (``/run/shoal-hosts``), so that parallel test workers each
get their own subnet; one left behind by a process that died is removed by the next one made.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

STATE_DIR = Path("/run/shoal-hosts")
CGROUPS = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "memory", "freezer")
SUBNET = "10.77.{net}.0/24"
CFS_PERIOD_US = 100_000


class HostsUnavailable(RuntimeError):
    """Test hosts cannot be made here (not root, no iproute2, no cgroups)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def check_available() -> None:
    """Raise ``HostsUnavailable`` saying what is missing to make test hosts here."""
    if os.geteuid() != 0:
        raise HostsUnavailable("test hosts need root (network namespaces, bridges, cgroups)")
    if shutil.which("ip") is None:
        raise HostsUnavailable("test hosts need iproute2's `ip` (apt-get install iproute2)")
    missing = [c for c in CONTROLLERS if not (CGROUPS / c / "cgroup.procs").exists()]
    if missing:
        raise HostsUnavailable(f"test hosts need cgroup v1 controllers: {', '.join(missing)}")


@dataclass
class Host:
    """One test host: its namespace, address, data directory and cgroups."""

    network: Network
    index: int
    name: str  # the network namespace
    address: str
    veth: str  # the bridge's end of its link
    dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def cgroups(self) -> list[Path]:
        return [CGROUPS / c / "shoal-hosts" / self.name for c in CONTROLLERS]

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: in its cgroups (first, so that everything it starts is
        in them too), then in its namespace."""
        enter = "; ".join(f"echo $$ > {g}/cgroup.procs" for g in self.cgroups)
        return ["sh", "-c", f'{enter}; exec ip netns exec {self.name} "$@"', "sh", *argv]

    def popen(
        self,
        argv: Sequence[str],
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        stdout: int | IO[bytes] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on this host, its output in ``log`` (appended) or ``stdout``."""
        out: int | IO[bytes] | None = stdout
        handle = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            handle = out = log.open("ab")
        try:
            proc = subprocess.Popen(
                self.argv(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if handle is not None:
                handle.close()
        self.procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to its end; its output."""
        return subprocess.run(
            self.argv(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=None if env is None else dict(env),
            cwd=cwd,
        )

    def pids(self) -> list[int]:
        """Every process running on this host (what its freezer cgroup holds)."""
        path = CGROUPS / "freezer" / "shoal-hosts" / self.name / "cgroup.procs"
        try:
            return [int(p) for p in path.read_text().split()]
        except FileNotFoundError:
            return []

    # --- faults -------------------------------------------------------------------------

    def partition(self) -> None:
        """Cut this host off the network (its link down), as a pulled cable."""
        _run("ip", "link", "set", self.veth, "down")

    def heal(self) -> None:
        _run("ip", "link", "set", self.veth, "up")

    def pause(self) -> None:
        """Freeze every process of the host (as SIGSTOP, and for those it starts later)."""
        self._freeze("FROZEN")

    def resume(self) -> None:
        self._freeze("THAWED")

    def kill(self) -> None:
        """The machine dies: every process on it SIGKILLed at once, saying nothing."""
        self._freeze("FROZEN")  # none forks or reacts while the others are being killed
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._freeze("THAWED")  # SIGKILL takes effect once thawed
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1)

    def _freeze(self, state: str) -> None:
        (CGROUPS / "freezer" / "shoal-hosts" / self.name / "freezer.state").write_text(state)

    # --- resources ----------------------------------------------------------------------

    def limit_cpu(self, cpus: float | None) -> None:
        """At most ``cpus`` cores for the whole host (None: no limit)."""
        quota = -1 if cpus is None else int(cpus * CFS_PERIOD_US)
        cpu = CGROUPS / "cpu" / "shoal-hosts" / self.name
        (cpu / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def limit_memory(self, limit: int | None) -> None:
        """At most ``limit`` bytes of memory for the whole host (None: no limit)."""
        value = "-1" if limit is None else str(limit)
        (CGROUPS / "memory" / "shoal-hosts" / self.name / "memory.limit_in_bytes").write_text(value)

    def shape(self, mbit: float | None) -> None:
        """Limit this host's link to ``mbit`` megabits a second each way (tc tbf); None lifts
        the limit."""
        for dev, ns in ((self.veth, None), ("eth0", self.name)):
            prefix = ["ip", "netns", "exec", ns] if ns else []
            if mbit is None:
                _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                continue
            burst = max(int(mbit * 1e6 / 8 / 250), 16 * 1024)  # 4 ms at the rate, at least 16K
            _run(
                *prefix,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "100ms",
            )


class Network:
    """``with Network(tmp, hosts=3) as net: net.hosts[0].popen([...])`` — the hosts live until
    the block ends; then every process on them is killed and the namespaces, links, bridge and
    cgroups are removed."""

    def __init__(
        self,
        base_dir: Path,
        hosts: int,
        cpus: float | None = None,
        memory: int | None = None,
    ) -> None:
        self.base_dir = base_dir
        self.size = hosts
        self.cpus = cpus
        self.memory = memory
        self.net = -1
        self.hosts: list[Host] = []

    @property
    def bridge(self) -> str:
        return f"shb{self.net}"

    @property
    def gateway(self) -> str:
        """The bridge's own address: how the root namespace (the test) is reached."""
        return f"10.77.{self.net}.254"

    def __enter__(self) -> Network:
        check_available()
        with _registry() as registry:
            self.net = registry.allocate(os.getpid())
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _make(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.size):
            name = f"sh{self.net}h{i}"
            veth = _veth(name)
            host = Host(self, i, name, f"10.77.{self.net}.{i + 1}", veth, self.base_dir / name)
            self.hosts.append(host)  # before it exists: close() removes what was made
            host.dir.mkdir(parents=True, exist_ok=True)
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "-n", name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "route", "add", "224.0.0.0/4", "dev", "eth0")
            for group in host.cgroups:
                group.mkdir(parents=True, exist_ok=True)
            host.limit_cpu(self.cpus)
            host.limit_memory(self.memory)

    def close(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(OSError):
                host.kill()
        _remove(self.net, [h.name for h in self.hosts])
        with _registry() as registry:
            registry.release(self.net)
        self.hosts = []

    def host(self, address: str) -> Host:
        return next(h for h in self.hosts if h.address == address)


def _veth(namespace: str) -> str:
    """The bridge's end of a host's link: ``sh<net>v<i>`` for the host ``sh<net>h<i>``."""
    net, _, index = namespace.rpartition("h")
    return f"{net}v{index}"


def _remove(net: int, namespaces: Sequence[str]) -> None:
    """Remove what network ``net`` made: links, namespaces, the bridge, the cgroups (once
    empty). The links first: a namespace outlives its name while sockets of it wait in
    TIME_WAIT, and its end of a link with it."""
    for name in namespaces:
        _run("ip", "link", "del", _veth(name), check=False)
        _run("ip", "netns", "del", name, check=False)
    _run("ip", "link", "del", f"shb{net}", check=False)
    for name in namespaces:
        for controller in CONTROLLERS:
            group = CGROUPS / controller / "shoal-hosts" / name
            if controller == "freezer" and group.exists():
                with contextlib.suppress(OSError):
                    (group / "freezer.state").write_text("THAWED")
            with contextlib.suppress(OSError):
                group.rmdir()


@dataclass
class _Registry:
    """Which network numbers are taken, and by which process (one JSON file each)."""

    dir: Path

    def allocate(self, owner: int) -> int:
        taken = set()
        for path in self.dir.glob("net-*.json"):
            entry = json.loads(path.read_text())
            if _alive(int(entry["owner"])):
                taken.add(int(entry["net"]))
            else:  # left behind by a process that died: clean it up
                names = [n for n in _namespaces() if n.startswith(f"sh{entry['net']}h")]
                _remove(int(entry["net"]), names)
                path.unlink()
        used = _run("ip", "-o", "-4", "addr").stdout
        links = _run("ip", "-o", "link").stdout
        for net in range(256):
            if net not in taken and f"10.77.{net}." not in used and f" sh{net}v" not in links:
                (self.dir / f"net-{net}.json").write_text(json.dumps({"net": net, "owner": owner}))
                return net
        raise HostsUnavailable("no free 10.77.x.0/24 network for test hosts")

    def release(self, net: int) -> None:
        (self.dir / f"net-{net}.json").unlink(missing_ok=True)


@contextlib.contextmanager
def _registry() -> Iterator[_Registry]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with (STATE_DIR / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield _Registry(STATE_DIR)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line]
