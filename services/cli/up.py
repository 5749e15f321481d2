"""`shoal up`: everything on one machine.

For now: the embedded nats-server (JetStream in the data directory), the streams, the
projector into SQLite in the data directory, and a planner. Later services join here as they
are built.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port, port_in_use
from bus.streams import StreamSettings
from projectors import database
from projectors.projector import Projector, tune_gc
from services.cli.options import default_data_dir, run_until_signal, setup_logging
from services.planner.planner import Planner

DEFAULT_NATS_PORT = 4222


def up(
    data_dir: Annotated[Path | None, typer.Option(help="Where the log and database live.")] = None,
    nats_port: Annotated[
        int | None,
        typer.Option(help="Port of the embedded nats-server [default: 4222, or a free one]."),
    ] = None,
    nats_host: Annotated[str, typer.Option(help="Address the nats-server listens on.")] = (
        "127.0.0.1"
    ),
    db: Annotated[str | None, typer.Option(help="Projection database URL.")] = None,
) -> None:
    """Start a one-machine Shoal: embedded NATS with JetStream and the projector."""
    setup_logging()
    tune_gc()
    data = data_dir or default_data_dir()
    db_url = db or f"sqlite:///{data / 'shoal.db'}"
    port = nats_port
    if port is None:
        # The usual port, unless something (often a system nats-server) has it already; a port
        # the user asked for is never swapped.
        port = DEFAULT_NATS_PORT
        if port_in_use(nats_host, port):
            port = free_port(nats_host)
            typer.echo(f"port {DEFAULT_NATS_PORT} is in use; the embedded NATS uses {port}")
    server = EmbeddedNats(data / "nats", port=port, host=nats_host)
    server.start()

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(server.url, name="shoal-up")
        engine = database.create_engine(db_url)
        projector = Projector(nc.jetstream(), engine, stream_settings=StreamSettings.from_env())
        task = asyncio.create_task(projector.run(stop))
        ready = asyncio.create_task(projector.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        planning: asyncio.Task[None] | None = None
        if ready.done():
            planning = asyncio.create_task(Planner(nc, engine, origin="planner@up").run(stop))
            typer.echo(f"NATS      {server.url}")
            typer.echo(f"database  {db_url}")
            typer.echo("ready: projecting the event log and planning (Ctrl-C stops)")
        try:
            await task
            if planning is not None:
                await planning
        finally:
            ready.cancel()
            await engine.dispose()
            await nc.drain()

    try:
        run_until_signal(main)
    finally:
        server.stop()
    typer.echo("stopped")
