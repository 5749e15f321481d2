"""Running `shoal up` (and `shoal join`) from a test as a user would: its output read until
the ready line, Ctrl-C to stop it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

MODEL = "smollm2-135m"
KEY = "test-key-1"
REPO = Path(__file__).resolve().parents[2]


def start(
    argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
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
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        finally:
            self._thread.join(timeout=10)
        return "".join(self.lines)


def stop(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C, as a user would; returns the rest of the output."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        raise
    return rest


async def wait_healthy(url: str, timeout: float = 30) -> None:
    async with httpx.AsyncClient() as client, asyncio.timeout(timeout):
        while True:
            try:
                if (await client.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
