"""A process that kills itself (SIGKILL) while it stores a snapshot of the projection, after
its first chunks went out and before the snapshot's meta:
``python -m tests.faults.killed_snapshot NATS_URL DB_URL``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from bus.connection import connect
from projectors import database, snapshot


def _kill_this_process(stored: int) -> None:
    if stored > 0:
        os.kill(os.getpid(), signal.SIGKILL)


async def main(nats_url: str, db_url: str) -> None:
    nc = await connect(nats_url, name="killed-snapshot")
    engine = database.create_engine(db_url)
    await snapshot.write(engine, nc.jetstream(), "main", on_progress=_kill_this_process)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
