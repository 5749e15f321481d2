"""When a worker starts its next warm spare: only once its runners are quiet (none loading,
none serving a task), as the spare's imports would take a core from them; and a runner killed
when it did not stop in time is reported."""

import asyncio
import signal
from pathlib import Path

from events.records import ShardAssignment
from services.runner import RunnerSpec
from services.worker.supervisor import SPARE_AFTER_S, SPARE_AT_LATEST_S, Supervised, Supervisor


async def _never(_spec: RunnerSpec, _code: int, _restarting: bool) -> None:
    raise AssertionError("no runner runs here")


def _due_in(sup: Supervisor) -> float:
    handle = sup._next_spare
    assert handle is not None
    return handle.when() - asyncio.get_running_loop().time()


async def test_the_spare_waits_for_every_runner_of_the_node_to_be_ready(tmp_path: Path) -> None:
    sup = Supervisor(_never, tmp_path, warm_spare=True)
    # As after a runner took the spare: the next one is due at the latest.
    sup._next_spare = asyncio.get_running_loop().call_later(SPARE_AT_LATEST_S, lambda: None)
    try:
        sup.runner_state("old", "Stopped")  # evicted for the new one, which is starting
        sup.runner_state("new", "Assigned")
        assert _due_in(sup) > SPARE_AT_LATEST_S - 1
        sup.runner_state("new", "Loading")
        assert _due_in(sup) > SPARE_AT_LATEST_S - 1
        sup.runner_state("new", "Ready")  # quiet: the spare comes shortly
        assert _due_in(sup) <= SPARE_AFTER_S
        sup.runner_state("new", "Running")  # its first task: not while it decodes
        assert _due_in(sup) > SPARE_AT_LATEST_S - 1
        sup.runner_state("other", "Loading")
        sup.runner_state("new", "Ready")  # another is still loading
        assert _due_in(sup) > SPARE_AT_LATEST_S - 1
        sup.runner_state("other", "Failed")
        assert _due_in(sup) <= SPARE_AFTER_S
    finally:
        assert sup._next_spare is not None
        sup._next_spare.cancel()


async def test_no_spare_is_due_when_none_was_taken(tmp_path: Path) -> None:
    sup = Supervisor(_never, tmp_path, warm_spare=True)
    sup.runner_state("r", "Ready")
    assert sup._next_spare is None


async def test_a_runner_killed_at_stop_is_reported(tmp_path: Path) -> None:
    """A runner asked to stop that does not in time is killed; having said nothing of its end,
    the supervisor tells its worker, which says it is Stopped and continues its tasks."""
    told: list[tuple[str, int, bool]] = []

    async def on_exit(spec: RunnerSpec, code: int, restarting: bool) -> None:
        told.append((spec.runner_id, code, restarting))

    sup = Supervisor(on_exit, tmp_path)
    shard = ShardAssignment(runner_id="r1", node_id="n", start_layer=0, end_layer=1, n_layers=1)
    spec = RunnerSpec(
        nats_url="nats://127.0.0.1:1",
        node_id="n",
        instance_id="i",
        model_id="m",
        shard=shard,
        cache_dir=str(tmp_path),
    )
    # A process that ignores SIGTERM, as a runner busy past its stop timeout.
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", "trap '' TERM; echo up; exec sleep 30", stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None and await proc.stdout.readline() == b"up\n"
    sup.runners["r1"] = Supervised(spec, proc)
    await sup.stop("r1", timeout=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert told == [("r1", -signal.SIGKILL, False)]
