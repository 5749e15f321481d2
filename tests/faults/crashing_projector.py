"""A projector process that kills itself (SIGKILL) once it has published a batch's dead letters,
before that batch's commit: ``python -m tests.faults.crashing_projector NATS_URL DB_URL``. The
fault is the test's, installed through the projector's hook: no setting of a production node
can make it crash."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from bus.connection import connect
from projectors import database
from projectors.projector import Projector

log = logging.getLogger(__name__)


def _kill_this_process() -> None:
    log.warning("dead letters published, batch not committed: killing this process")
    os.kill(os.getpid(), signal.SIGKILL)


async def main(nats_url: str, db_url: str) -> None:
    nc = await connect(nats_url, name="crashing-projector")
    engine = database.create_engine(db_url)
    await Projector(nc.jetstream(), engine, after_dead_letters=_kill_this_process).run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
