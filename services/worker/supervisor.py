"""Starting, watching and restarting runner processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bus.embedded import die_with_parent
from services.runner.spec import RunnerSpec
from services.worker.reconcile import restart_delay

log = logging.getLogger(__name__)

# A runner that stayed up this long before dying starts its backoff afresh.
HEALTHY_AFTER_S = 60.0

OnExit = Callable[[RunnerSpec, int, bool], Awaitable[None]]


# A runner reads its spec from its standard input: the spec holds the NATS URL, which may
# hold credentials (nats://TOKEN@host), and a command line is anyone's to read (ps, /proc).
RUNNER_COMMAND = [str(Path(sys.executable).parent / "shoal"), "runner", "--spec", "-"]


async def start_runner(
    spec: RunnerSpec, stdout: int | IO[Any], env: dict[str, str] | None = None, **kwargs: Any
) -> asyncio.subprocess.Process:
    """A runner process for ``spec``, given its spec on a pipe (``RUNNER_COMMAND``)."""
    proc = await asyncio.create_subprocess_exec(
        *RUNNER_COMMAND,
        stdin=asyncio.subprocess.PIPE,
        stdout=stdout,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        **kwargs,
    )
    assert proc.stdin is not None
    proc.stdin.write(spec.model_dump_json().encode())
    await proc.stdin.drain()
    proc.stdin.close()
    return proc


def _pipeline_env(spec: RunnerSpec) -> dict[str, str]:
    """A pipeline's stages compute one after the other. libgomp's idle threads spin a while
    before they sleep: between tokens, one stage's spinning threads took the cores from the
    stage computing when stages share a machine. A spin count of 10,000 still spins through
    ggml's barriers within a graph (OMP_WAIT_POLICY=PASSIVE, which sleeps at each one, is
    slower) and sleeps soon after (bench/pipeline.py measures it; docs/runners.md has the
    figures)."""
    return {"GOMP_SPINCOUNT": "10000"} if spec.shard.world_size > 1 else {}


@dataclass
class Supervised:
    spec: RunnerSpec
    proc: asyncio.subprocess.Process | None = None
    watcher: asyncio.Task[None] | None = None
    failures: int = 0
    stopping: bool = False
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """One runner process per shard; a runner that dies is reported through ``on_exit`` and
    restarted with bounded backoff until it is asked to stop."""

    def __init__(self, on_exit: OnExit, log_dir: Path) -> None:
        self._on_exit = on_exit
        self._log_dir = log_dir
        self.runners: dict[str, Supervised] = {}

    def pid(self, runner_id: str) -> int | None:
        s = self.runners.get(runner_id)
        return s.proc.pid if s is not None and s.proc is not None else None

    async def start(self, spec: RunnerSpec) -> None:
        if spec.runner_id in self.runners:
            return
        entry = Supervised(spec)
        self.runners[spec.runner_id] = entry
        await self._spawn(entry)
        entry.watcher = asyncio.create_task(self._watch(entry))

    async def _spawn(self, entry: Supervised) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"runner-{entry.spec.runner_id}.log"
        with log_path.open("ab") as out:
            entry.proc = await start_runner(
                entry.spec,
                out,
                # A runner must not outlive its worker (a worker killed with SIGKILL would leave
                # a runner nobody supervises), and only its worker stops it: in a session of
                # its own, a Ctrl-C at the terminal does not reach it behind the worker's back.
                preexec_fn=die_with_parent,
                start_new_session=True,
                # ggml attaches gdb to print a backtrace when it aborts (a lost RPC stage):
                # seconds of ptrace and pages of log for a failure the runner's events explain.
                env={"GGML_NO_BACKTRACE": "1", **_pipeline_env(entry.spec), **os.environ},
            )
        entry.started_at = time.monotonic()
        log.info("started runner %s (pid %d)", entry.spec.runner_id, entry.proc.pid)

    async def _watch(self, entry: Supervised) -> None:
        while True:
            assert entry.proc is not None
            code = await entry.proc.wait()
            if entry.stopping:
                return
            if time.monotonic() - entry.started_at > HEALTHY_AFTER_S:
                entry.failures = 0
            entry.failures += 1
            await self._on_exit(entry.spec, code, True)
            delay = restart_delay(entry.failures)
            log.warning(
                "runner %s exited (%d); restart %d in %.1fs",
                entry.spec.runner_id,
                code,
                entry.failures,
                delay,
            )
            await asyncio.sleep(delay)
            if entry.stopping:
                return
            await self._spawn(entry)

    async def stop(self, runner_id: str, timeout: float = 10.0) -> None:
        entry = self.runners.pop(runner_id, None)
        if entry is None:
            return
        entry.stopping = True
        proc = entry.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if entry.watcher is not None:
            entry.watcher.cancel()

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(r) for r in list(self.runners)))
