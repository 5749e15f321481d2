"""`shoal up`: everything on one machine.

For now: the embedded nats-server (JetStream in the data directory), the streams and the
projector into SQLite in the data directory. Later services join here as they are built.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.streams import StreamSettings
from projectors import database
from projectors.projector import Projector, tune_gc
from services.cli.options import default_data_dir, run_until_signal, setup_logging


def up(
    data_dir: Annotated[Path | None, typer.Option(help="Where the log and database live.")] = None,
    nats_port: Annotated[int, typer.Option(help="Port of the embedded nats-server.")] = 4222,
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
    server = EmbeddedNats(data / "nats", port=nats_port, host=nats_host)
    server.start()

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(server.url, name="shoal-up")
        engine = database.create_engine(db_url)
        projector = Projector(nc.jetstream(), engine, stream_settings=StreamSettings.from_env())
        task = asyncio.create_task(projector.run(stop))
        ready = asyncio.create_task(projector.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            typer.echo(f"NATS      {server.url}")
            typer.echo(f"database  {db_url}")
            typer.echo("ready: projecting the event log (Ctrl-C stops)")
        try:
            await task
        finally:
            ready.cancel()
            await engine.dispose()
            await nc.drain()

    try:
        run_until_signal(main)
    finally:
        server.stop()
    typer.echo("stopped")
