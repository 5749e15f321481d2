"""The `shoal` command line."""

from __future__ import annotations

import typer

from services.cli import db, events
from services.cli.projector import projector, replay_command
from services.cli.state import state
from services.cli.up import up

app = typer.Typer(
    help="Shoal: run language models across a cluster, with an event log as the control plane.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(up)
app.command()(projector)
app.command("replay")(replay_command)
app.command()(state)
app.add_typer(db.app, name="db")
app.add_typer(events.app, name="events")


def main() -> None:
    app()
