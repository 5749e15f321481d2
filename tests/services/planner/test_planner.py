"""The planner as a process: real nats-server, projector and planners, on the real log."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from events.catalogue import (
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    NodeTimedOut,
    PlacementRejected,
    ResourceProfiled,
)
from events.records import NodeProfile
from events.units import MiB
from harness.processes import SHOAL, Processes
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow


async def _nodes(pub: Publisher, offered: dict[str, int], heartbeat_s: float = 3600) -> None:
    """Nodes as their workers announce themselves (without runners: no model runs here)."""
    for node, memory in offered.items():
        await pub.publish(NodeJoined(node_id=node, origin=node, heartbeat_s=heartbeat_s))
        profile = NodeProfile(
            ram_total=memory * 2, ram_available=memory, cpu_count=2, memory_offered=memory
        )
        await pub.publish(ResourceProfiled(node_id=node, origin=node, profile=profile))


def _model(model_id: str = "m", size: int = 100 * MiB, layers: int = 10) -> ModelAdded:
    return ModelAdded(
        model_id=model_id,
        origin="test",
        n_layers=layers,
        size_bytes=size,
        context_length=4096,
        kv_bytes_per_token=1024,
        overhead_bytes=10 * MiB,
    )


async def test_two_planners_make_one_decision_per_request(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    log = await EventLog().start(js)
    pub = Publisher(js)
    with Processes(tmp_path / "logs") as procs:
        procs.start("projector", "projector", "--nats", nats_server.url, "--db", db)
        for name in ("planner-1", "planner-2"):
            procs.start(name, "planner", "--nats", nats_server.url, "--db", db)
        await _nodes(pub, {"a": 2048 * MiB, "b": 1024 * MiB, "c": 512 * MiB})
        await pub.publish(_model())
        ids = [f"i{n}" for n in range(20)]
        for iid in ids:
            await pub.publish(InstanceRequested(instance_id=iid, model_id="m", origin="test"))
        # One too big for the whole cluster: rejected, once.
        await pub.publish(_model("huge", size=10_000 * MiB))
        await pub.publish(InstanceRequested(instance_id="big", model_id="huge", origin="test"))
        await log.wait_count(InstancePlaced, lambda e: True, len(ids), timeout=60)
        rejected = await log.wait_for(PlacementRejected, lambda e: e.instance_id == "big")
        # Both planners had time to act on every event; any second decision would be here now.
        await pub.publish(InstanceDeleteRequested(instance_id="i0", origin="test"))
        await log.wait_for(InstanceDeleted, lambda e: e.instance_id == "i0", timeout=30)
        placed = Counter(e.instance_id for e in log.of(InstancePlaced))
        assert placed == Counter(ids)
        assert len(log.of(PlacementRejected)) == 1
        assert len(log.of(InstanceDeleted)) == 1
        assert "huge needs" in rejected.reason and rejected.needed_bytes is not None
        # The memory each placement charged was taken into account by the next one:
        # 20 x ~110 MiB over nodes offering 2048, 1024 and 512 MiB uses all three.
        nodes = Counter(s.node_id for e in log.of(InstancePlaced) for s in e.shards)
        assert set(nodes) == {"a", "b", "c"} and nodes["a"] > nodes["b"] > nodes["c"]
        assert all(e.generation == 1 for e in log.of(InstancePlaced))
    # Each decision was stored by exactly one of the two planners.
    logs = procs.log("planner-1") + procs.log("planner-2")
    for iid in [*ids, "big"]:
        assert (
            logs.count(f"placement:{iid}:1 placed") + logs.count(f"placement:{iid}:1 rejected") == 1
        )
    print(f"decisions the other planner had already made: {logs.count('was already decided')}")


HEARTBEAT_S = 1.0


async def test_a_silent_node_times_out_and_its_instance_moves(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    log = await EventLog().start(js)
    pub = Publisher(js)
    with Processes(tmp_path / "logs") as procs:
        procs.start("projector", "projector", "--nats", nats_server.url, "--db", db)
        procs.start("planner", "planner", "--nats", nats_server.url, "--db", db)
        beating = {"a": 1024 * MiB, "b": 512 * MiB}

        async def heartbeats() -> None:
            # Beating four times as often as each node says it does: a test process slowed by
            # a busy machine still keeps its live node within its interval.
            while True:
                await _nodes(pub, beating, heartbeat_s=HEARTBEAT_S)
                await asyncio.sleep(HEARTBEAT_S / 4)

        beat = asyncio.create_task(heartbeats())
        try:
            await pub.publish(_model())
            await pub.publish(InstanceRequested(instance_id="i", model_id="m", origin="test"))
            first = await log.wait_for(InstancePlaced, timeout=30)
            assert [s.node_id for s in first.shards] == ["a"]
            del beating["a"]  # a falls silent; b keeps beating
            timed_out = await log.wait_for(NodeTimedOut, timeout=20)
            again = await log.wait_for(InstancePlaced, lambda e: e.generation == 2, timeout=20)
        finally:
            beat.cancel()
        assert timed_out.node_id == "a" and timed_out.missed_heartbeats >= 3
        assert [s.node_id for s in again.shards] == ["b"]
        assert again.reason == "node a is timed out"
        # Noticed about three missed heartbeats after it was last seen.
        assert timed_out.ts - timed_out.last_seen < timedelta(seconds=3 * HEARTBEAT_S + 2)


async def test_cli_preview_create_list_delete(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {
        **os.environ,
        "SHOAL_DATA_DIR": str(tmp_path / "data"),
        "SHOAL_NATS_URL": nats_server.url,
        "SHOAL_DB_URL": db,
    }

    async def shoal(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run, [SHOAL, *args], capture_output=True, text=True, env=env, timeout=90
        )

    with Processes(tmp_path / "logs", env) as procs:
        procs.start("projector", "projector")
        procs.start("planner", "planner")
        await procs.wait_log("projector", "resuming after seq")
        await _nodes(Publisher(js), {"n-a": 1024 * MiB, "n-b": 512 * MiB})
        # A catalogue model the cluster does not know yet is previewed from its card.
        carded = await shoal("placement", "preview", "smollm2-135m")
        assert carded.returncode == 0 and "n-a:cpu" in carded.stdout, carded.stderr
        unknown = await shoal("placement", "preview", "no-such-model")
        assert unknown.returncode == 1 and "neither known to the cluster" in unknown.stderr

        # A built-in model is added on the way; the planner places it where the spec says.
        spec = '{"chat": {"devices": ["n-b:cpu"]}}'
        created = await shoal(
            "instances",
            "create",
            "smollm2-135m",
            "--placement",
            spec,
            "--id",
            "inst-1",
            "--slots",
            "2",
            "--kv-cache",
            "q8_0",
        )
        assert created.returncode == 0, created.stderr
        assert "placed inst-1 on n-b:cpu[0:30], 2 slots each, KV cache q8_0" in created.stdout

        # Automatic placement now prefers n-a, which has the most room left.
        preview = await shoal("placement", "preview", "smollm2-135m")
        assert preview.returncode == 0, preview.stderr
        assert "n-a:cpu  layers 0-29 (30)" in preview.stdout

        for bad_spec, message in [
            ('{"chat": {"devices": ["zz:cpu"]}}', "unknown node 'zz' (nodes: n-a, n-b)"),
            ('{"chat": {"devices": ["n-a:gpu0"]}}', "node 'n-a' has no device gpu0 (it has: cpu)"),
            (
                '{"chat": {"devices": ["n-b:cpu"], "replicas": 2}}',
                "replica 2 of 2: n-b:cpu: its share (the whole model) needs",
            ),
        ]:
            result = await shoal("placement", "preview", "smollm2-135m", "--placement", bad_spec)
            assert result.returncode == 1 and message in result.stdout, result.stdout
        syntax = await shoal("instances", "create", "smollm2-135m", "--placement", "{chat")
        assert syntax.returncode == 1 and "not valid JSON" in syntax.stderr
        refused = await shoal(
            "instances",
            "create",
            "smollm2-135m",
            "--placement",
            '{"chat": {"devices": ["n-b:cpu"], "replicas": 2}}',
        )
        assert refused.returncode == 1 and "--queue requests it anyway" in refused.stderr
        unknown = await shoal("placement", "preview", "smollm2-135m", "--kv-cache", "q5")
        assert unknown.returncode == 1
        assert "kv_cache: 'q5' is not one of f16, q8_0, q4_0, auto" in unknown.stderr

        listed = await shoal("instances", "list", "--json")
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (row["instance_id"], row["slots"], row["kv_cache"]) == ("inst-1", 2, "q8_0")
        assert [(s["node"], s["state"]) for s in row["shards"]] == [("n-b", "Assigned")]
        listed = await shoal("instances", "list")
        assert "inst-1" in listed.stdout and "n-b:cpu [0:30] Assigned" in listed.stdout
        deleted = await shoal("instances", "delete", "inst-1")
        assert deleted.returncode == 0 and "deleted inst-1" in deleted.stdout
        missing = await shoal("instances", "delete", "nope")
        assert missing.returncode == 1 and "no instance 'nope'" in missing.stderr
