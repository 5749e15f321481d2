"""Models loaded on demand, as a user of Ollama's client sees them: `shoal up --no-model
--max-loaded 1`, then chats with SmolLM2, Gemma 3 270M and SmolLM2 again, through the real
`ollama` client. Neither model was added or placed by hand: each request loads its model
(a catalogue card, added on the way), and each load makes room by unloading the other."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import ollama
import pytest

from bus.connection import connect
from bus.embedded import free_port
from bus.streams import EVENTS_STREAM
from events.catalogue import InstanceDeleted, InstanceRequested, parse_event
from events.subjects import aggregate_filter
from harness.processes import SHOAL
from harness.shoal_up import Drained, read_until_ready, start

pytestmark = pytest.mark.slow

SMOLLM2, GEMMA = "smollm2-135m", "gemma3-270m"


async def instance_events(nats_url: str) -> list[InstanceRequested | InstanceDeleted]:
    nc = await connect(nats_url, name="test-on-demand")
    try:
        js = nc.jetstream()
        sub = await js.subscribe(aggregate_filter("instance"), ordered_consumer=True)
        info = await js.stream_info(EVENTS_STREAM)
        found: list[InstanceRequested | InstanceDeleted] = []
        last = 0
        while last < info.state.last_seq:
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                break
            last = msg.metadata.sequence.stream
            event = parse_event(msg.data)
            if isinstance(event, InstanceRequested | InstanceDeleted):
                found.append(event)
        await sub.unsubscribe()
        return found
    finally:
        await nc.close()


async def test_each_request_loads_its_model_and_makes_room(tmp_path: Path) -> None:
    up = start(
        [
            SHOAL,
            "up",
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            str(free_port("127.0.0.1")),
            "--no-model",
            "--max-loaded",
            "1",
            "--runner-threads",
            "1",
            # The default, named: the suite's other tests start workers without a spare.
            "--warm-runner",
        ]
    )
    lines = await read_until_ready(up)
    drained = Drained(up)
    try:
        url = next(x for x in lines if x.startswith("ready:")).split()[1].removesuffix("/v1")
        nats_url = next(x for x in lines if x.startswith("NATS")).split()[1]
        client = ollama.AsyncClient(host=url, timeout=300)
        added: set[str] = set()
        for name in (SMOLLM2, GEMMA, SMOLLM2):
            added.add(name)
            reply = await client.chat(
                model=name,
                messages=[{"role": "user", "content": "Say hi."}],
                options={"num_predict": 4, "temperature": 0},
            )
            assert reply.done and reply.message.role == "assistant", name
            loaded = [m.model for m in (await client.ps()).models]
            assert loaded == [f"{name}:latest"], loaded  # the other was unloaded for it
            async with httpx.AsyncClient(base_url=url) as http:
                tags = (await http.get("/api/tags")).json()["models"]
                listed = (await http.get("/v1/models")).json()["data"]
            # Every model that can be asked for is listed (the catalogue's cards, added on the
            # way when asked for), and says whether it is added and whether it is loaded.
            assert {t["name"] for t in tags} >= {f"{m}:latest" for m in (SMOLLM2, GEMMA)}
            assert {
                t["name"]: (t["added"], t["loaded"]) for t in tags if t["added"] or t["loaded"]
            } == {f"{m}:latest": (True, m == name) for m in added}
            assert {
                m["id"]: (m["added"], m["loaded"]) for m in listed if m["added"] or m["loaded"]
            } == {m: (True, m == name) for m in added}
        events = await instance_events(nats_url)
        asked = [(e.model_id, e.on_demand) for e in events if isinstance(e, InstanceRequested)]
        assert asked == [(SMOLLM2, True), (GEMMA, True), (SMOLLM2, True)]
        room = [e.reason for e in events if isinstance(e, InstanceDeleted)]
        assert room == [
            f"unloaded to make room for {GEMMA} ({GEMMA}-chat-on-demand-0)",
            f"unloaded to make room for {SMOLLM2} ({SMOLLM2}-chat-on-demand-1)",
        ]
    finally:
        await asyncio.to_thread(drained.stop)
    # Each load took the runner started ahead (its imports done), whose output went to the
    # runner's own log once it knew which runner it was.
    logs = [
        p
        for p in (tmp_path / "data" / "worker" / "logs").glob("runner-*.log")
        if p.name != "runner-spare.log"
    ]
    assert len(logs) == 3, logs
    assert all("the warm spare, started" in p.read_text() for p in logs), logs
    # A runner unloaded to make room left its process, imports done, to the next: no spare was
    # started meanwhile, its imports competing with the load and the first token.
    assert any("which served 1 runner(s) before" in p.read_text() for p in logs), logs
