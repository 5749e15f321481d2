"""A projector process killed after publishing a batch's dead letters and before that batch's
commit: the dead letter is kept (published before the commit, it cannot be lost with it), and
the restarted projector, which applies the batch again, does not store it twice."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.consumer import REASON_HEADER, SEQ_HEADER
from bus.embedded import EmbeddedNats
from bus.streams import DEADLETTER_STREAM, EVENTS_STREAM
from events.catalogue import NodeJoined
from harness.history import history
from harness.processes import Processes
from projectors import database
from projectors.rules import fold
from projectors.store import read_counts, read_offset
from tests.conftest import MakeDb
from tests.projectors.helpers import db_rows, memory_rows, publish_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_dead_letters_outlive_a_crash_before_the_commit(
    nats_server: EmbeddedNats, js: JetStreamContext, make_db: MakeDb, tmp_path: Path
) -> None:
    good = [e for e in history(n_tasks=10, seed=3) if e.type != "ChunkGenerated"]
    # Valid, but a hostname longer than its column: set aside as "cannot be stored".
    unstorable = NodeJoined(node_id="n-long", origin="t", hostname="h" * 300)
    await publish_all(js, good[:20])
    bad_seq = await publish_all(js, [unstorable])
    last = await publish_all(js, good[20:])
    db_url = await make_db()
    args = ("projector", "--nats", nats_server.url, "--db", db_url)
    engine = database.create_engine(db_url)
    try:
        crashing = Processes(tmp_path / "crash")
        with crashing:
            argv = [
                sys.executable,
                "-m",
                "tests.faults.crashing_projector",
                nats_server.url,
                db_url,
            ]
            proc = crashing.start_argv("projector", argv)
            assert await asyncio.to_thread(proc.wait, 60) == -signal.SIGKILL
        log = crashing.log("projector")
        assert "cannot be stored: nodes.hostname" in log and "killing this process" in log
        async with engine.connect() as conn:
            assert await read_offset(conn, "main", EVENTS_STREAM) < bad_seq  # not committed
        dead = await js.stream_info(DEADLETTER_STREAM)
        assert dead.state.messages == 1  # ...and yet published

        with Processes(tmp_path / "again") as again:
            again.start("projector", *args)
            async with asyncio.timeout(60):
                while True:
                    async with engine.connect() as conn:
                        if await read_offset(conn, "main", EVENTS_STREAM) == last:
                            break
                    await asyncio.sleep(0.05)
        # The batch was applied again and its dead letter published again: stored once.
        dead = await js.stream_info(DEADLETTER_STREAM)
        assert dead.state.messages == 1
        letter = await js.get_msg(DEADLETTER_STREAM, dead.state.last_seq)
        assert letter.headers is not None and letter.headers[SEQ_HEADER] == str(bad_seq)
        assert letter.headers[REASON_HEADER].startswith("cannot be stored")
        assert await db_rows(engine) == memory_rows(fold(good))
        async with engine.connect() as conn:
            counts = await read_counts(conn, "main", EVENTS_STREAM)
        assert counts["NodeJoined"] == sum(e.type == "NodeJoined" for e in good) + 1
    finally:
        await engine.dispose()
