"""The `shoal` command line, run as real processes against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port
from bus.publisher import Publisher
from bus.stores.claim_check import checked_in
from bus.stores.parts import PartStore
from events.catalogue import NodeJoined, ResourceProfiled, TaskCreated
from events.records import ChatMessage, Tool
from harness.history import history, profile
from projectors import database
from projectors.replay import replay
from tests.projectors.helpers import db_rows_of, publish_all

REPO = Path(__file__).resolve().parents[2]
SHOAL = str(Path(sys.executable).parent / "shoal")


def shoal(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SHOAL, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


async def ashoal(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(shoal, *args, timeout=timeout)


def test_events_doc_is_up_to_date() -> None:
    out = shoal("events", "doc")
    assert out.returncode == 0
    assert (REPO / "docs" / "events.md").read_text() == out.stdout, (
        "docs/events.md is stale: run `shoal events doc > docs/events.md`"
    )


def test_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    first, second = shoal("db", "upgrade", "--db", url), shoal("db", "upgrade", "--db", url)
    assert first.returncode == second.returncode == 0
    versions = Path(__file__).parents[2] / "migrations" / "versions"
    newest = max(p.name[:4] for p in versions.glob("0*.py"))
    assert f"revision {newest}" in second.stdout


def test_bad_database_url_is_a_clear_error(tmp_path: Path) -> None:
    out = shoal("db", "upgrade", "--db", "mysql://x/y")
    assert out.returncode != 0
    assert "unsupported database URL" in out.stderr
    assert "Traceback" not in out.stderr


async def test_events_dump_writes_json_lines(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    events = [e for e in history(n_tasks=10) if e.type != "ChunkGenerated"]
    await publish_all(js, events)
    await js.publish("shoal.events.node.x.NodeJoined", b"garbage")
    out_file = tmp_path / "dump.jsonl"
    out = await ashoal("events", "dump", "--nats", nats_server.url, "-o", str(out_file))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [line["seq"] for line in lines] == list(range(1, len(events) + 2))
    assert [line["event"]["event_id"] for line in lines[:-1]] == [e.event_id for e in events]
    assert lines[-1]["raw"] == "garbage"
    assert all(line["subject"].startswith("shoal.events.") for line in lines)

    part = await ashoal(
        "events", "dump", "--nats", nats_server.url, "--from-seq", "3", "--to-seq", "5"
    )
    assert [json.loads(x)["seq"] for x in part.stdout.splitlines()] == [3, 4, 5]

    chunks = await ashoal("events", "dump", "--nats", nats_server.url, "--stream", "chunks")
    assert chunks.stdout == ""  # publish_all sent no chunks here
    assert (await ashoal("events", "dump", "--stream", "nope")).returncode != 0


async def test_events_dump_puts_a_tasks_parts_back(
    nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    """A task naming its messages and tools as parts (bus/stores/parts.py) is dumped whole, so that
    a dump restores into a cluster that has no parts; --keep-refs dumps it as stored."""
    task = TaskCreated(
        task_id="t",
        model_id="m",
        origin="api",
        messages=[ChatMessage(role="user", content="hi")],
        tools=[Tool(name="f")],
    )
    await Publisher(js).publish(await checked_in(PartStore(js), task))
    whole = await ashoal("events", "dump", "--nats", nats_server.url)
    event = json.loads(whole.stdout)["event"]
    assert event["messages"] == [{**task.model_dump(mode="json")["messages"][0]}]
    assert event["tools"][0]["name"] == "f" and event["messages_ref"] is None
    stored = await ashoal("events", "dump", "--nats", nats_server.url, "--keep-refs")
    event = json.loads(stored.stdout)["event"]
    assert event["messages"] is None and event["messages_ref"]["parts"] == 1


async def test_state_prints_the_projection(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    events = [e for e in history(n_tasks=30) if e.type != "ChunkGenerated"]
    await publish_all(js, events)
    url = f"sqlite:///{tmp_path / 'p.db'}"
    engine = database.create_engine(url)
    await replay(js, engine)
    await engine.dispose()

    out = await ashoal("state", "--db", url, "--json", "--tasks", "5")
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout)
    assert sorted(n["node_id"] for n in state["nodes"]) == ["node-a", "node-b", "node-c"]
    assert len(state["tasks"]) == 5
    assert {i["instance_id"]: i["status"] for i in state["instances"]} == {
        "inst-1": "deleted",
        "inst-2": "placed",
        "inst-3": "rejected",
    }
    table = await ashoal("state", "--db", url)
    assert table.returncode == 0
    for word in ("nodes (3)", "instances (3)", "node-a", "inst-2", "rejected"):
        assert word in table.stdout


async def test_replay_refuses_a_used_database(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    await Publisher(js).publish(NodeJoined(node_id="a", origin="a"))
    url = f"sqlite:///{tmp_path / 'r.db'}"
    assert (await ashoal("replay", "--nats", nats_server.url, "--db", url)).returncode == 0
    again = await ashoal("replay", "--nats", nats_server.url, "--db", url)
    assert again.returncode == 2
    assert "not empty" in again.stderr and "Traceback" not in again.stderr


async def _read_line_with(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> str:
        for line in stdout:
            if needle in line:
                return line
        raise AssertionError(f"process ended before printing {needle!r}")

    return await asyncio.wait_for(asyncio.to_thread(read), timeout)


async def test_events_tail_prints_live_events(
    nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    proc = subprocess.Popen(
        [SHOAL, "events", "tail", "--nats", nats_server.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        pub = Publisher(js)
        line_task = asyncio.create_task(_read_line_with(proc, "node-q", 20))
        # The tail starts at new events once it has subscribed: publish until one shows up.
        while not line_task.done():
            heartbeat = ResourceProfiled(
                node_id="node-q", origin="node-q", profile=profile(random.Random(1))
            )
            await pub.publish(heartbeat)
            await asyncio.sleep(0.3)
        line = await line_task
        assert "ResourceProfiled" in line and "node_id=node-q" in line
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
    assert proc.returncode == 0


async def test_up_starts_nats_and_projector_and_stops_cleanly(tmp_path: Path) -> None:
    """Without a model (tests/cli/test_up.py serves one): the services come up and go
    down."""
    port = free_port()
    proc = subprocess.Popen(
        [
            SHOAL,
            "up",
            "--data-dir",
            str(tmp_path / "data"),
            "--nats-port",
            str(port),
            "--port",
            str(free_port()),
            "--no-model",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        await _read_line_with(proc, "ready", 60)
        from bus.connection import connect

        nc = await connect(f"nats://127.0.0.1:{port}")
        await Publisher(nc.jetstream()).publish(NodeJoined(node_id="via-up", origin="t"))
        await nc.close()
        db = f"sqlite:///{tmp_path / 'data' / 'shoal.db'}"
        async with asyncio.timeout(20):
            while "via-up" not in (await ashoal("state", "--db", db, "--json")).stdout:
                await asyncio.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, rest
    assert "stopped" in rest
    # The embedded server is gone with it.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_up_on_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = shoal("up", "--data-dir", str(tmp_path), "--nats-port", str(port), timeout=30)
        api = shoal("up", "--data-dir", str(tmp_path), "--port", str(port), timeout=30)
    for result in (out, api):
        assert result.returncode == 1
        assert "already in use" in result.stderr
        assert "Traceback" not in result.stderr
    assert "--port" in api.stderr


async def test_a_dump_restored_into_a_new_cluster_replays_to_the_same_projection(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    events = [e for e in history(n_tasks=20) if e.type != "ChunkGenerated"]
    await publish_all(js, events)
    await js.publish("shoal.events.node.x.NodeJoined", b"garbage")  # set aside, also when restored
    backup = tmp_path / "backup.jsonl"
    out = await ashoal("events", "dump", "--nats", nats_server.url, "-o", str(backup))
    assert out.returncode == 0, out.stderr

    with EmbeddedNats(tmp_path / "new-nats") as new:
        restored = await ashoal("events", "restore", str(backup), "--nats", new.url)
        assert restored.returncode == 0, restored.stderr
        assert f"restored {len(events) + 1} messages" in restored.stderr
        again = await ashoal("events", "restore", str(backup), "--nats", new.url)
        assert again.returncode == 1 and "restore into a new, empty cluster" in again.stderr
        copy = tmp_path / "copy.jsonl"
        assert (await ashoal("events", "dump", "--nats", new.url, "-o", str(copy))).returncode == 0
        nc = await connect(new.url)
        try:
            rows = []
            for source, name in ((js, "old"), (nc.jetstream(), "new")):
                url = f"sqlite:///{tmp_path / name}.db"
                engine = database.create_engine(url)
                await replay(source, engine)
                await engine.dispose()
                rows.append(await db_rows_of(url))
        finally:
            await nc.close()
    assert rows[0] == rows[1] and rows[0]["tasks"]

    def unstamped(path: Path) -> list[dict[str, object]]:
        return [
            {k: v for k, v in json.loads(line).items() if k != "stored_at"}
            for line in path.read_text().splitlines()
        ]

    assert unstamped(copy) == unstamped(backup)  # same sequences, subjects, headers, events
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"subject": "shoal.events.x"}\n')
    with EmbeddedNats(tmp_path / "third") as third:
        refused = await ashoal("events", "restore", str(bad), "--nats", third.url)
    assert refused.returncode == 1 and "line 1: not a line of `shoal events dump`" in refused.stderr
