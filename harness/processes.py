"""The processes tests and benchmarks start (`shoal` subcommands, nats-servers, other servers):
each started with its output in a log file, waited for until it is ready, stopped with a signal
(SIGINT as Ctrl-C, SIGTERM as an operator) and killed with SIGKILL past a deadline.

``Proc`` is one such process; ``Processes`` is the named processes of one test or benchmark,
stopped together on the way out. A process started in a session of its own (the default: a
Ctrl-C on the test or benchmark is for it, not for what it started) is killed with its whole
session, its children (a worker's runners) included.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from harness.hosts import Host

SHOAL = str(Path(sys.executable).parent / "shoal")


def end(
    proc: subprocess.Popen[Any],
    sig: int | None = signal.SIGINT,
    timeout: float = 60.0,
    *,
    group: bool = False,
    kill_group: bool = False,
    wait: Callable[[float | None], object] | None = None,
) -> bool:
    """``sig`` to ``proc`` (to its whole process group with ``group``) unless it has ended
    (``None``: no signal, it was sent already), then up to ``timeout`` seconds for it to end;
    past that, SIGKILL (to its process group with ``kill_group``) and wait again. True when it
    ended by itself. ``wait`` waits for it (``proc.wait`` by default; a process whose output is
    a pipe is waited for by reading it)."""
    wait = wait or (lambda t: proc.wait(t))
    if sig is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
    try:
        wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            if kill_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        wait(None)
        return False


async def wait_until(
    ready: Callable[[], Awaitable[bool]],
    alive: Callable[[], None],
    timeout: float,
    interval: float,
    timed_out: Callable[[], str],
) -> None:
    """Until ``ready()``; ``alive()`` raises if what should become ready has died; past
    ``timeout`` seconds a RuntimeError saying ``timed_out()``."""
    deadline = time.monotonic() + timeout
    while not await ready():
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError(timed_out())
        await asyncio.sleep(interval)


class Proc:
    """A process started by a test or benchmark, its output in a log file (truncated when it
    starts; appended to on a test host)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self.session = False  # started in a session of its own: killed with it

    def start(
        self,
        env: Mapping[str, str] | None = None,
        *,
        host: Host | None = None,
        session: bool = True,
        stdin: bool = False,
    ) -> Proc:
        """Start it: on ``host`` when given (a test host: in a session of its own there, killed
        alone), else here, in a session of its own with ``session``; ``stdin``: this
        process's input, else none."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if host is not None:
            self.log_path.unlink(missing_ok=True)
            self.popen = host.popen(self.argv, self.log_path, env)
            return self
        with self.log_path.open("wb") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=None if stdin else subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                start_new_session=session,
            )
        self.session = session
        return self

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 0

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:] or "(no output)"

    def check_running(self) -> None:
        """Raise, with the end of its log, if it has exited."""
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")

    async def wait_for(
        self,
        ready: Callable[[], Awaitable[bool]],
        what: str,
        timeout: float,
        interval: float = 0.2,
    ) -> None:
        """Until ``ready()``; a RuntimeError with the end of its log if it exits first or
        ``timeout`` seconds pass."""

        def alive() -> None:
            if not self.running:
                raise RuntimeError(f"{self.name} exited before {what}:\n{self.tail()}")

        def late() -> str:
            return f"{self.name}: no {what} in {timeout:.0f} s:\n{self.tail()}"

        await wait_until(ready, alive, timeout, interval, late)

    async def wait_log(self, text: str, timeout: float = 30) -> None:
        """Until ``text`` appears in its log (e.g. a line saying it is ready)."""
        async with asyncio.timeout(timeout):
            while text not in self.log():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
                await asyncio.sleep(0.05)

    def send(self, sig: int) -> None:
        """``sig`` to it, if it is running."""
        if self.running:
            self.proc.send_signal(sig)

    def stop(self, sig: int | None = signal.SIGINT, timeout: float = 60.0) -> bool:
        """``sig`` (SIGINT: as Ctrl-C; None: already sent), then SIGKILL (to its session if
        it has one of its own) if it has not ended in ``timeout`` seconds. True when it ended
        by itself."""
        if self.popen is None:
            return True
        return end(self.popen, sig, timeout, kill_group=self.session)

    async def astop(self, sig: int | None = signal.SIGINT, timeout: float = 60.0) -> bool:
        """``stop``, waited for off the event loop."""
        return await asyncio.to_thread(self.stop, sig, timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL to it alone (a crash), and wait for it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout)


class Processes:
    """Named processes (`shoal` subcommands by default) started for one test or benchmark; each
    logs to ``<log_dir>/<name>.log``. Leaving the ``with`` block stops those still running
    (``sig`` to all, then SIGKILL to each not ended in ``timeout`` seconds) and prints the tail
    of each log, which pytest shows when the test failed."""

    def __init__(
        self,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        *,
        session: bool = False,
        sig: int = signal.SIGTERM,
        timeout: float = 20.0,
        tails: bool = True,
    ) -> None:
        self.log_dir = log_dir
        self.env = env
        self.session = session
        self.sig = sig
        self.timeout = timeout
        self.tails = tails
        self.named: dict[str, Proc] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        return {name: p.proc for name, p in self.named.items()}

    def start(self, name: str, *args: str, host: Host | None = None) -> subprocess.Popen[bytes]:
        """`shoal ARGS`, on ``host`` when given (a test host), else on this machine."""
        return self.start_argv(name, [SHOAL, *args], host)

    def start_argv(
        self, name: str, argv: list[str], host: Host | None = None
    ) -> subprocess.Popen[bytes]:
        """Any program, logged and stopped as the `shoal` subcommands are."""
        proc = Proc(name, argv, self.log_dir / f"{name}.log")
        self.named[name] = proc.start(
            self.env, host=host, session=self.session, stdin=not self.session
        )
        return proc.proc

    def log(self, name: str) -> str:
        return self.named[name].log()

    async def wait_log(self, name: str, text: str, timeout: float = 30) -> None:
        """Until ``text`` appears in the process's log (e.g. a line saying it is ready)."""
        await self.named[name].wait_log(text, timeout)

    def kill(self, name: str) -> None:
        self.named[name].kill()

    def stop_all(self) -> list[str]:
        """``sig`` to every process still running, then wait for each (SIGKILL past the
        deadline); how each ended."""
        for proc in self.named.values():
            proc.send(self.sig)
        said = []
        for name, proc in self.named.items():
            ended = proc.stop(None, self.timeout)
            said.append(f"{name}: exit {proc.returncode}" if ended else f"{name}: killed")
            if self.tails:
                sys.stdout.write(f"--- {name} (exit {proc.returncode})\n{proc.log()[-3000:]}\n")
        return said

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


async def wait_healthy(url: str, timeout: float = 30) -> None:
    """Until ``url``'s ``/healthz`` answers 200 (refused connections are asked again)."""
    async with httpx.AsyncClient() as client, asyncio.timeout(timeout):
        while True:
            try:
                if (await client.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
