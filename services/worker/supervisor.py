"""Starting, watching and restarting runner processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bus.embedded import die_with_parent
from events.states import RUNNER_ENDED, RunnerState
from services.runner import RunnerSpec
from services.worker.reconcile import restart_delay

log = logging.getLogger(__name__)

# A runner that stayed up this long before dying starts its backoff afresh.
HEALTHY_AFTER_S = 60.0
# When the next warm spare starts: this long after the node's runners are all Ready (a runner
# just loaded decodes its first task's prompt meanwhile, and a runner stopped in between leaves
# its process as the spare), or at the latest this long after the last change.
SPARE_AFTER_S = 1.0
SPARE_AT_LATEST_S = 30.0

# Told of a runner process that ended unasked (restarting: True), or that was killed after it
# did not stop in time when asked to (False): with its spec and exit code.
OnExit = Callable[[RunnerSpec, int, bool], Awaitable[None]]


# A runner reads its spec from its standard input: the spec holds the NATS URL, which may
# hold credentials (nats://TOKEN@host), and a command line is anyone's to read (ps, /proc).
RUNNER_COMMAND = [str(Path(sys.executable).parent / "shoal"), "runner", "--spec", "-"]


async def start_runner(
    spec: RunnerSpec, stdout: int | IO[Any], env: dict[str, str] | None = None, **kwargs: Any
) -> asyncio.subprocess.Process:
    """A runner process for ``spec``, given its spec on a pipe (``RUNNER_COMMAND``)."""
    proc = await spawn_runner(stdout, env, **kwargs)
    await give_spec(proc, spec)
    return proc


async def spawn_runner(
    stdout: int | IO[Any], env: dict[str, str] | None = None, preload: bool = False, **kwargs: Any
) -> asyncio.subprocess.Process:
    """A runner process that imports what it runs on, then waits for its spec
    (``give_spec``); with ``preload``, llama.cpp's engine too (``shoal runner --preload``)."""
    return await asyncio.create_subprocess_exec(
        *RUNNER_COMMAND,
        *(["--preload"] if preload else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=stdout,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        **kwargs,
    )


async def give_spec(proc: asyncio.subprocess.Process, spec: RunnerSpec) -> None:
    """One line: the pipe stays open for the spec after it, should the process be recycled."""
    assert proc.stdin is not None
    proc.stdin.write(spec.model_dump_json().encode() + b"\n")
    await proc.stdin.drain()


def _pipeline_env(spec: RunnerSpec) -> dict[str, str]:
    """A pipeline's stages compute one after the other. libgomp's idle threads spin a while
    before they sleep: between tokens, one stage's spinning threads took the cores from the
    stage computing when stages share a machine. A spin count of 10,000 still spins through
    ggml's barriers within a graph (OMP_WAIT_POLICY=PASSIVE, which sleeps at each one, is
    slower) and sleeps soon after (bench/pipeline.py measures it; docs/runners.md has the
    figures)."""
    return {"GOMP_SPINCOUNT": "10000"} if spec.shard.world_size > 1 else {}


def _runner_kwargs(env: dict[str, str]) -> dict[str, Any]:
    """How a runner process is started, with ``env`` added to this process's environment."""
    return {
        # A runner must not outlive its worker (a worker killed with SIGKILL would leave a
        # runner nobody supervises), and only its worker stops it: in a session of its own, a
        # Ctrl-C at the terminal does not reach it behind the worker's back.
        "preexec_fn": die_with_parent,
        "start_new_session": True,
        # ggml attaches gdb to print a backtrace when it aborts (a lost RPC stage): seconds of
        # ptrace and pages of log for a failure the runner's events explain.
        "env": {"GGML_NO_BACKTRACE": "1", **env, **os.environ},
    }


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
    restarted with bounded backoff until it is asked to stop.

    ``warm_spare``: one runner process is kept started ahead, its imports done (most of a
    runner's start), waiting for a spec: the next runner of a whole model takes it, and another
    is started for the one after. A runner of a pipeline's stage is started afresh: its
    environment differs (``_pipeline_env``)."""

    def __init__(self, on_exit: OnExit, log_dir: Path, *, warm_spare: bool = False) -> None:
        self._on_exit = on_exit
        self._log_dir = log_dir
        self.runners: dict[str, Supervised] = {}
        self._warm_spare = warm_spare
        # Whether the spare loads llama.cpp before its spec: only where no accelerator is, as
        # a runner sees only its shard's accelerators, which its spec names (the worker sets it).
        self.preload = False
        self._spare: asyncio.subprocess.Process | None = None
        self._refilling: asyncio.Task[None] | None = None
        self._next_spare: asyncio.TimerHandle | None = None
        self._states: dict[str, RunnerState] = {}  # what this node's runners last said
        self._stopped: dict[str, asyncio.Event] = {}  # runners being recycled, until Stopped

    def warm(self) -> None:
        """Start the spare, if there is to be one and none is there or being started."""
        if not self._warm_spare or self._refilling is not None:
            return
        if self._spare is not None and self._spare.returncode is None:
            return
        self._refilling = asyncio.create_task(self._start_spare())

    async def _start_spare(self) -> None:
        try:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            # Its own output until it is given a spec (an import that fails, say).
            with (self._log_dir / "runner-spare.log").open("ab") as out:
                self._spare = await spawn_runner(out, preload=self.preload, **_runner_kwargs({}))
        except OSError:
            log.exception("could not start a spare runner")
        finally:
            self._refilling = None

    async def _take_spare(self, spec: RunnerSpec) -> asyncio.subprocess.Process | None:
        """The spare, given ``spec`` (its output then goes to the runner's log); None when there
        is none ready, or ``spec``'s runner needs an environment of its own."""
        if self._refilling is not None:
            await self._refilling  # a moment: it is spawned, not imported, when this returns
        spare, self._spare = self._spare, None
        if spare is None or spare.returncode is not None or _pipeline_env(spec):
            self._spare = spare if spare is not None and spare.returncode is None else None
            return None
        log_path = self._log_dir / f"runner-{spec.runner_id}.log"
        try:
            await give_spec(spare, spec.model_copy(update={"log_path": str(log_path)}))
        except (BrokenPipeError, ConnectionResetError):
            return None  # it died meanwhile: start one afresh
        return spare

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
        entry.proc = await self._take_spare(entry.spec)
        warm = entry.proc is not None
        if entry.proc is None:
            log_path = self._log_dir / f"runner-{entry.spec.runner_id}.log"
            with log_path.open("ab") as out:
                kwargs = _runner_kwargs(_pipeline_env(entry.spec))
                entry.proc = await start_runner(entry.spec, out, **kwargs)
        entry.started_at = time.monotonic()
        log.info(
            "started runner %s (pid %d%s)",
            entry.spec.runner_id,
            entry.proc.pid,
            ", the warm spare" if warm else "",
        )
        # The next spare once the node's runners are quiet (``runner_state``): at the latest a
        # while later.
        self._next_spare = asyncio.get_running_loop().call_later(SPARE_AT_LATEST_S, self.warm)

    def runner_state(self, runner_id: str, state: RunnerState) -> None:
        """A runner of this node changed state (its worker heard it). The next spare waits until
        none of them is starting or serving a task: its imports take a core for most of a
        second, which slowed a runner's load, or the first task of a runner just loaded, several
        times over on two cores (bench/cold_start.py)."""
        if state == "Stopped" and (stopped := self._stopped.get(runner_id)) is not None:
            stopped.set()
        if state in RUNNER_ENDED:
            self._states.pop(runner_id, None)
        else:
            self._states[runner_id] = state
        if self._next_spare is None:  # no spare is due
            return
        self._next_spare.cancel()
        quiet = all(s == "Ready" for s in self._states.values())
        delay = SPARE_AFTER_S if quiet else SPARE_AT_LATEST_S
        self._next_spare = asyncio.get_running_loop().call_later(delay, self.warm)

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
            if self._recyclable(entry.spec) and await self._recycle(runner_id, proc, timeout):
                if entry.watcher is not None:
                    entry.watcher.cancel()
                return
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                log.warning("runner %s did not stop in %.0f s: killed", runner_id, timeout)
                proc.kill()
                # It said nothing of its end, and may have held tasks: its worker says so.
                await self._on_exit(entry.spec, await proc.wait(), False)
        if entry.watcher is not None:
            entry.watcher.cancel()

    def _recyclable(self, spec: RunnerSpec) -> bool:
        """Whether a stopped runner's process becomes the next spare (its imports done, no
        second of CPU to start another): as a spare could have served it (a whole chat model
        on llama.cpp, on a node without accelerators, whose spare loads the engine ahead)."""
        return (
            self._warm_spare
            and self.preload
            and spec.engine == "llamacpp"
            and spec.role == "chat"
            and spec.shard.world_size == 1
        )

    async def _recycle(
        self, runner_id: str, proc: asyncio.subprocess.Process, timeout: float
    ) -> bool:
        """Stop the runner with SIGUSR1 (its process frees the model and waits for another
        spec); True once it said Stopped, with the process kept as the spare."""
        stopped = self._stopped[runner_id] = asyncio.Event()
        try:
            proc.send_signal(signal.SIGUSR1)
            ended = asyncio.ensure_future(proc.wait())
            said = asyncio.ensure_future(stopped.wait())
            try:
                await asyncio.wait({ended, said}, timeout=timeout, return_when=FIRST_COMPLETED)
            finally:
                ended.cancel()
                said.cancel()
        finally:
            self._stopped.pop(runner_id, None)
        if not stopped.is_set() or proc.returncode is not None:
            return False
        if self._refilling is not None:
            await self._refilling
        spare, self._spare = self._spare, proc
        if spare is not None and spare.returncode is None:
            spare.kill()  # one spare is enough: this one is as ready, and holds nothing either
            await spare.wait()
        log.info("runner %s stopped: its process (pid %d) is the next spare", runner_id, proc.pid)
        return True

    async def stop_all(self) -> None:
        self._warm_spare = False
        if self._next_spare is not None:
            self._next_spare.cancel()
        if self._refilling is not None:
            await self._refilling
        spare, self._spare = self._spare, None
        if spare is not None and spare.returncode is None:
            spare.kill()  # it holds nothing yet
            await spare.wait()
        await asyncio.gather(*(self.stop(r) for r in list(self.runners)))
