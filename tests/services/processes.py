"""Starting real `shoal` processes from a test, and stopping them (with their logs shown)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from harness.hosts import Host

SHOAL = str(Path(sys.executable).parent / "shoal")


class Processes:
    """`shoal` subcommands started for one test; each logs to ``<dir>/<name>.log``. Leaving
    the ``with`` block stops them all (SIGTERM, then SIGKILL) and prints the tail of each log,
    which pytest shows when the test failed."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, host: Host | None = None) -> subprocess.Popen[bytes]:
        """`shoal ARGS`, on ``host`` when given (a test host), else on this machine."""
        return self.start_argv(name, [SHOAL, *args], host)

    def start_argv(
        self, name: str, argv: list[str], host: Host | None = None
    ) -> subprocess.Popen[bytes]:
        """Any program, logged and stopped as the `shoal` subcommands are."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        if host is not None:
            log.unlink(missing_ok=True)
            proc = host.popen(argv, log, self.env)
        else:
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    async def wait_log(self, name: str, text: str, timeout: float = 30) -> None:
        """Until ``text`` appears in the process's log (e.g. a line saying it is ready)."""
        async with asyncio.timeout(timeout):
            while text not in self.log(name):
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited with {self.procs[name].returncode}")
                await asyncio.sleep(0.05)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            sys.stdout.write(f"--- {name} (exit {proc.returncode})\n{self.log(name)[-3000:]}\n")
