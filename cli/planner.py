"""`shoal planner`: decide where models run."""

from __future__ import annotations

import asyncio
import socket
from typing import Annotated

import typer

from bus.connection import connect
from bus.sync_policy import warn_if_lazy
from cli.options import (
    DEFAULT_DB,
    DEFAULT_KEEP_ALIVE_TEXT,
    DEFAULT_NATS,
    DbUrl,
    KeepAlive,
    MaxLoaded,
    NatsUrl,
    keep_alive_s,
    run_until_signal,
    setup_logging,
)
from projectors import database
from projectors.projector import DEFAULT_NAME, tune_gc
from services.planner.decisions import PlannerPolicy
from services.planner.planner import Planner


def planner(
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
    missed_heartbeats: Annotated[
        int, typer.Option(min=1, help="Heartbeat intervals of silence before a node times out.")
    ] = 3,
    failure_limit: Annotated[
        int, typer.Option(min=1, help="Runner failures within --failure-window that move it.")
    ] = 3,
    failure_window: Annotated[
        float, typer.Option(min=1, help="Seconds in which --failure-limit failures count.")
    ] = 120.0,
    projector: Annotated[
        str, typer.Option(help="Name of the projector whose database this is.")
    ] = DEFAULT_NAME,
    keep_alive: KeepAlive = DEFAULT_KEEP_ALIVE_TEXT,
    max_loaded: MaxLoaded = None,
) -> None:
    """Run a planner: place instances, time out silent nodes, move failing instances.

    Needs a running projector on the same database. Several planners may run at once."""
    setup_logging()
    tune_gc()  # a round at 1,000 nodes allocates enough for full collections to double its p95
    policy = PlannerPolicy(
        missed_heartbeats=missed_heartbeats,
        failure_limit=failure_limit,
        failure_window_s=failure_window,
        default_keep_alive_s=keep_alive_s(keep_alive),
        max_loaded=max_loaded,
    )
    origin = f"planner@{socket.gethostname()}"

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(nats, name="shoal-planner")
        await warn_if_lazy(nats)
        engine = database.create_engine(db)
        try:
            await Planner(nc, engine, policy, origin=origin, projector=projector).run(stop)
        finally:
            await engine.dispose()
            await nc.drain()

    run_until_signal(main)
