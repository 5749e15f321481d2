"""The `shoal` command line."""

from __future__ import annotations

import sys

import typer
from sqlalchemy.exc import DBAPIError

from bus.connection import NatsUnavailable
from bus.embedded import NatsServerError
from bus.nats_security import NatsSecurityError
from bus.streams import StreamSettingsError
from cli.api import api
from cli.nats_options import nats_security_options
from cli.planner import planner
from cli.projector import projector, replay_command
from cli.state import state
from cli.up import up
from cli.worker import runner, worker
from projectors.database import DatabaseUrlError
from projectors.replay import ReplayError
from cli import db, events, instances, models

app = typer.Typer(
    help="Shoal: run language models across a cluster, with an event log as the control plane.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.callback()(nats_security_options)
app.command()(up)
app.command()(projector)
app.command("replay")(replay_command)
app.command()(state)
app.command()(worker)
app.command()(planner)
app.command()(api)
app.command("join", help="Join a running cluster as a worker (the same as `shoal worker`).")(worker)
app.command(hidden=True)(runner)
app.add_typer(db.app, name="db")
app.add_typer(events.app, name="events")
app.add_typer(models.app, name="models")
app.add_typer(instances.app, name="instances")
app.add_typer(instances.placement_app, name="placement")


# Errors a user can cause and fix: one line, no traceback.
_USER_ERRORS = (
    NatsUnavailable,
    NatsServerError,
    NatsSecurityError,
    StreamSettingsError,
    DatabaseUrlError,
    ReplayError,
    DBAPIError,
)


def main() -> None:
    try:
        app()
    except _USER_ERRORS as exc:
        message = f"database: {exc.orig}" if isinstance(exc, DBAPIError) else str(exc)
        typer.echo(f"error: {message}", err=True)
        sys.exit(2 if isinstance(exc, ReplayError) else 1)
