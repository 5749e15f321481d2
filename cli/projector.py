"""`shoal projector` and `shoal replay`."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

import typer

from bus.connection import connect
from bus.sync_policy import warn_if_lazy
from cli.options import (
    DEFAULT_DB,
    DEFAULT_NATS,
    DbUrl,
    NatsUrl,
    Retain,
    run_until_signal,
    setup_logging,
    stream_settings,
)
from projectors import database
from projectors.projector import DEFAULT_NAME, ProjectionLost, Projector, tune_gc
from projectors.replay import replay
from projectors.store import OffsetConflict


def projector(
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
    name: Annotated[str, typer.Option(help="Projector name (its tracking row).")] = DEFAULT_NAME,
    retain: Retain = None,
) -> None:
    """Run the projector: fold the event log into the projection database."""
    settings = stream_settings(retain)
    setup_logging()
    tune_gc()

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(nats, name=f"shoal-projector-{name}")
        await warn_if_lazy(nats)
        engine = database.create_engine(db)
        try:
            await Projector(nc.jetstream(), engine, name=name, stream_settings=settings).run(stop)
        except (database.ProjectorRunning, OffsetConflict, ProjectionLost):
            raise SystemExit(1) from None  # the projector logged why
        finally:
            await engine.dispose()
            await nc.drain()

    run_until_signal(main)


def _parse_time(value: str) -> datetime:
    try:
        t = datetime.fromisoformat(value)
    except ValueError as exc:
        raise typer.BadParameter(f"not an ISO 8601 time: {value!r}") from exc
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


def replay_command(
    nats: NatsUrl = DEFAULT_NATS,
    db: Annotated[str, typer.Option("--db", help="A NEW database to build.")] = "",
    until_seq: Annotated[int | None, typer.Option(help="Stop after this stream sequence.")] = None,
    until_time: Annotated[
        str | None, typer.Option(help="Stop before events stored after this ISO time (UTC).")
    ] = None,
    from_snapshot: Annotated[
        bool,
        typer.Option(
            help="Start from the newest snapshot at or before where it stops; without, from"
            " the first event (the whole log must be kept)."
        ),
    ] = True,
) -> None:
    """Build a fresh projection from the log, up to a sequence or a time."""
    if not db:
        raise typer.BadParameter("--db is required: the new database to build", param_hint="--db")
    if until_seq is not None and until_time is not None:
        raise typer.BadParameter("give --until-seq or --until-time, not both")
    until = _parse_time(until_time) if until_time else None
    tune_gc()

    async def main() -> None:
        nc = await connect(nats, name="shoal-replay")
        engine = database.create_engine(db)
        try:
            result = await replay(
                nc.jetstream(),
                engine,
                until_seq=until_seq,
                until_time=until,
                from_snapshot=from_snapshot,
            )
        finally:
            await engine.dispose()
            await nc.close()
        typer.echo(
            f"replayed {result.applied} events up to seq {result.last_seq}"
            f" ({result.skipped} malformed skipped) into {db}"
        )

    asyncio.run(main())
