"""The planner on a 3-server NATS cluster: a change of the events stream's leader (its server
lost) leaves heartbeats unstorable for the seconds of an election; nodes are not timed out for
that, and one that really fell silent still is."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bus.connection import connect
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM, StreamSettings, ensure_streams
from events.catalogue import NodeJoined, NodeTimedOut, ResourceProfiled
from events.records import NodeProfile
from harness.clusters import NatsCluster
from harness.hosts import Network
from harness.processes import Processes
from tests.bus.nats_cluster import make_leader, stream_info
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

HEARTBEAT_S = 2.0
MISSED = 6  # heartbeats missed before a node times out: room for a slow leader change


async def test_a_node_silent_while_the_events_stream_changed_leader_is_not_timed_out(
    tmp_path: Path,
    hosts: Network,
) -> None:
    """While a stream elects a leader (its leader's server lost) nothing can be stored, and a
    node's heartbeats land only once it has one: the planner counts silence from the change
    it sees (here a leader moved by hand, then a node silent past its time-out)."""
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {**os.environ, "SHOAL_STREAM_REPLICAS": "3"}
    loop = asyncio.get_running_loop()
    timeout_s = MISSED * HEARTBEAT_S
    async with NatsCluster(tmp_path / "nats", hosts) as cluster:
        nc = await connect(cluster.urls_from(0), name="test")
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings(replicas=3))
        log = await EventLog().start(js)
        pub = Publisher(js)
        with Processes(tmp_path / "logs", env) as procs:
            procs.start("projector", "projector", "--nats", cluster.urls_from(0), "--db", db)
            procs.start(
                "planner",
                "planner",
                "--nats",
                cluster.urls_from(0),
                "--db",
                db,
                "--missed-heartbeats",
                str(MISSED),
            )
            # The planner must see the leader before and after the change: on a loaded machine
            # its start (imports, connecting) takes seconds.
            await procs.wait_log("planner", "watching from seq", timeout=60)
            beating = {"a", "b"}
            last_beat: dict[str, float] = {}
            profile = NodeProfile(
                ram_total=2**31, ram_available=2**30, cpu_count=2, memory_offered=2**30
            )

            async def heartbeats() -> None:
                for node in sorted(beating):
                    await pub.publish(
                        NodeJoined(node_id=node, origin=node, heartbeat_s=HEARTBEAT_S)
                    )
                while True:
                    for node in sorted(beating):
                        await pub.publish(
                            ResourceProfiled(node_id=node, origin=node, profile=profile)
                        )
                        last_beat[node] = loop.time()
                    await asyncio.sleep(HEARTBEAT_S)

            beat = asyncio.create_task(heartbeats())
            try:
                leader = (await stream_info(nc, EVENTS_STREAM)).cluster
                first = "n1" if leader is None or leader.leader != "n1" else "n2"
                await make_leader(nc, EVENTS_STREAM, first)
                await asyncio.sleep(2.5 * HEARTBEAT_S)  # the planner has looked at the stream
                beating.discard("a")
                silent_since = last_beat["a"]
                # The times below follow the measured ones: a leader change can take seconds on
                # a loaded machine, and a silence longer than the time-out before it is a real
                # one.
                await asyncio.sleep(max(0.0, silent_since + 2 * HEARTBEAT_S - loop.time()))
                await make_leader(nc, EVENTS_STREAM, "n0" if first != "n0" else "n2")
                changed = loop.time()
                # a comes back past its time-out counted from its last heartbeat, and seconds
                # before the one counted from the change (the planner may see the new leader
                # a little before make_leader returns), for its heartbeat to be stored
                back = silent_since + timeout_s + HEARTBEAT_S / 2
                assert changed - silent_since < timeout_s - HEARTBEAT_S, "the change was too slow"
                assert changed + timeout_s - back >= HEARTBEAT_S
                await asyncio.sleep(back - loop.time())
                beating.add("a")
                await pub.publish(ResourceProfiled(node_id="a", origin="a", profile=profile))
                await asyncio.sleep(2 * HEARTBEAT_S)
                assert not log.of(NodeTimedOut)
                beating.discard("a")  # a really falls silent; b goes on
                timed_out = await log.wait_for(NodeTimedOut, timeout=30)
                await asyncio.sleep(2 * HEARTBEAT_S)
            finally:
                beat.cancel()
            assert timed_out.node_id == "a"
            assert [e.node_id for e in log.of(NodeTimedOut)] == ["a"]
        await log.stop()
        await nc.close()
