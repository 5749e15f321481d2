"""Running `shoal up` (and `shoal join`) as a user would: in a session of its own, its output
read from a pipe until the ready line, Ctrl-C to its session to stop it (SIGKILL to the session
if it has not stopped in a minute)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from harness.processes import end

STOP_TIMEOUT = 60.0  # seconds a Ctrl-C'd `shoal up` has to stop


def start(
    argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``argv`` with its output (stdout and stderr) in a pipe; ``env`` added to this one's."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        start_new_session=True,
        env=None if env is None else os.environ | env,
    )


async def read_until_ready(proc: subprocess.Popen[str], timeout: float = 180) -> list[str]:
    """Its lines up to its ``ready:`` line; its output so far is printed if it exits first or
    ``timeout`` seconds pass."""
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                return
        raise RuntimeError("exited before it was ready:\n" + "".join(lines))

    try:
        await asyncio.wait_for(asyncio.to_thread(read), timeout)
    except BaseException:
        sys.stdout.write("".join(lines))
        raise
    return lines


def stop(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C, as a user would; returns the rest of the output (TimeoutExpired, once killed, if
    it did not stop in time)."""
    rest: list[str] = []

    def drain(timeout: float | None) -> None:
        rest.append(proc.communicate(timeout=timeout)[0])

    if not end(proc, signal.SIGINT, STOP_TIMEOUT, group=True, kill_group=True, wait=drain):
        raise subprocess.TimeoutExpired(proc.args, STOP_TIMEOUT)
    return rest[-1]


class Drained:
    """The rest of a started process's output, read as it comes by a thread of its own: a
    process that lives long (a session's `shoal up`) would block once the pipe is full."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> str:
        """Ctrl-C, as a user would; returns what it wrote since it was ready."""
        try:
            if not end(self.proc, signal.SIGINT, STOP_TIMEOUT, group=True, kill_group=True):
                raise subprocess.TimeoutExpired(self.proc.args, STOP_TIMEOUT)
        finally:
            self._thread.join(timeout=10)
        return "".join(self.lines)
