"""Re-placement with real workers and runners: three nodes on test hosts of their own (each
with its own address, node id and memory limit) serving SmolLM2 through llama.cpp; NATS, the
projector and the planner on this machine, across the hosts' bridge."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from events.catalogue import (
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    NodeTimedOut,
    PlacementRejected,
    RunnerStateChanged,
    TaskCompleted,
    TaskCreated,
)
from events.records import ChatMessage, SamplingParams
from harness.hosts import Network
from harness.processes import SHOAL, Processes
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

# SmolLM2 at 2048 tokens needs about 206 MiB; 90% of each limit leaves room for one.
LIMITS = {"w-a": "400M", "w-b": "330M", "w-c": "300M"}


def _ready(runner_id: str) -> Callable[[RunnerStateChanged], bool]:
    return lambda e: e.runner_id == runner_id and e.state == "Ready"


def _start_cluster(procs: Processes, nats: str, db: str, tmp: Path, hosts: Network) -> None:
    procs.start("projector", "projector", "--nats", nats, "--db", db)
    procs.start("planner", "planner", "--nats", nats, "--db", db)
    for (node, limit), host in zip(LIMITS.items(), hosts.hosts, strict=True):
        procs.start(
            node,
            "worker",
            "--nats",
            nats,
            "--node-id",
            node,
            "--data-dir",
            str(tmp / node),
            "--memory-limit",
            limit,
            "--heartbeat",
            "1",
            "--runner-threads",
            "1",
            host=host,
        )


async def test_a_dead_node_s_instance_is_placed_again_and_serves(
    hosts: Network, hosts_nats: EmbeddedNats, hosts_js: JetStreamContext, tmp_path: Path
) -> None:
    js, nats_server = hosts_js, hosts_nats
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {**os.environ, "SHOAL_DATA_DIR": str(tmp_path / "cli")}
    log = await EventLog().start(js)
    with Processes(tmp_path / "logs", env) as procs:
        _start_cluster(procs, nats_server.url, db, tmp_path, hosts)
        await log.wait_count(NodeJoined, lambda e: True, 3, timeout=60)
        await procs.wait_log("projector", "resuming after seq")
        created = await asyncio.to_thread(
            subprocess.run,
            [
                SHOAL,
                "instances",
                "create",
                "smollm2-135m",
                "--id",
                "inst",
                "--nats",
                nats_server.url,
                "--db",
                db,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert created.returncode == 0, created.stderr
        first = await log.wait_for(InstancePlaced, timeout=30)
        assert [s.node_id for s in first.shards] == ["w-a"]  # the most room
        runner = first.shards[0].runner_id
        await log.wait_for(RunnerStateChanged, _ready(runner), timeout=90)

        assert not log.of(NodeTimedOut)  # heartbeats kept coming while the model loaded
        killed_at = time.monotonic()
        hosts.hosts[0].kill()  # w-a's machine dies: its worker and runner at once
        timed_out = await log.wait_for(NodeTimedOut, timeout=30)
        again = await log.wait_for(InstancePlaced, lambda e: e.generation == 2, timeout=30)
        moved = again.shards[0].runner_id
        await log.wait_for(RunnerStateChanged, _ready(moved), timeout=90)
        recovered_s = time.monotonic() - killed_at
        print(f"w-a killed -> NodeTimedOut, placed again, Ready in {recovered_s:.1f} s")
        assert timed_out.node_id == "w-a"
        assert [s.node_id for s in again.shards] == ["w-b"] and "node w-a" in again.reason
        assert recovered_s < 30  # 3 s of silence, a planner tick, a runner start

        await Publisher(js).publish(
            TaskCreated(
                task_id="t1",
                model_id="smollm2-135m",
                origin="test",
                messages=[
                    ChatMessage(
                        role="user",
                        content="What is the capital city of France? Answer in one word.",
                    )
                ],
                params=SamplingParams(max_tokens=8, temperature=0.0),
            )
        )
        done = await log.wait_for(TaskCompleted, lambda e: e.task_id == "t1", timeout=60)
        assert done.runner_id == moved
        assert "Paris" in "".join(c.text for c in await log.wait_chunks("t1"))


@pytest.mark.parametrize("hosts", [2], indirect=True)
async def test_a_runner_that_keeps_failing_moves_then_is_rejected(
    hosts: Network, hosts_nats: EmbeddedNats, hosts_js: JetStreamContext, tmp_path: Path
) -> None:
    """Weights that no engine can load fail on every node: the instance moves from node to
    node, then is rejected, and stays rejected (no loop)."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 4096)
    js, nats_server = hosts_js, hosts_nats
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    log = await EventLog().start(js)
    pub = Publisher(js)
    with Processes(tmp_path / "logs") as procs:
        procs.start("projector", "projector", "--nats", nats_server.url, "--db", db)
        procs.start(
            "planner", "planner", "--nats", nats_server.url, "--db", db, "--failure-window", "60"
        )
        commands = (("w-a", "worker"), ("w-b", "join"))  # join: the same command
        for (node, command), host in zip(commands, hosts.hosts, strict=True):
            procs.start(
                node,
                command,
                "--nats",
                nats_server.url,
                "--node-id",
                node,
                "--data-dir",
                str(tmp_path / node),
                "--heartbeat",
                "0.5",
                host=host,
            )
        await log.wait_count(NodeJoined, lambda e: True, 2, timeout=60)
        await pub.publish(
            ModelAdded(
                model_id="broken",
                origin="test",
                n_layers=4,
                size_bytes=4100,
                path=str(broken),
                source="path",
            )
        )
        await pub.publish(InstanceRequested(instance_id="bad", model_id="broken", origin="test"))
        rejected = await log.wait_for(PlacementRejected, timeout=120)
        placed = log.of(InstancePlaced)
        assert [p.shards[0].node_id for p in placed] in (["w-a", "w-b"], ["w-b", "w-a"])
        assert placed[1].avoid == [f"{placed[0].shards[0].node_id}:cpu"]
        # At least 3 failures; on a busy machine one more may come before the planner's round.
        assert re.search(r"failed [3-9] times", rejected.reason), rejected.reason
        assert "cannot be placed again" in rejected.reason
        assert "the only devices online are w-a:cpu, w-b:cpu, where its runners kept failing" in (
            rejected.reason
        )
        await asyncio.sleep(3)  # a planner that looped would decide again by now
        assert len(log.of(PlacementRejected)) == 1 and len(log.of(InstancePlaced)) == 2
