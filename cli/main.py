"""The `shoal` command line.

Only the command that runs is imported: every `shoal` process (a runner, a projector, a planner
started by a worker or a test) would otherwise import the API, the database layer and every
other command first, seconds of CPU on a small machine before it does anything. `shoal` alone,
`shoal --help` or an unknown command loads them all, to list them.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

from bus.nats_import import import_nats_without_websockets

import_nats_without_websockets()

import typer  # noqa: E402

from cli.nats_options import nats_security_options  # noqa: E402

# A command: the module and the function that define it, and how it is registered.
_COMMANDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "up": ("cli.up", "up", {}),
    "projector": ("cli.projector", "projector", {}),
    "replay": ("cli.projector", "replay_command", {}),
    "state": ("cli.state", "state", {}),
    "worker": ("cli.worker", "worker", {}),
    "planner": ("cli.planner", "planner", {}),
    "api": ("cli.api", "api", {}),
    "join": (
        "cli.worker",
        "worker",
        {"help": "Join a running cluster as a worker (the same as `shoal worker`)."},
    ),
    "runner": ("cli.worker", "runner", {"hidden": True}),
}
# A group of commands: the module and its Typer app.
_GROUPS: dict[str, tuple[str, str]] = {
    "db": ("cli.db", "app"),
    "events": ("cli.events", "app"),
    "keys": ("cli.keys", "app"),
    "models": ("cli.models", "app"),
    "instances": ("cli.instances", "app"),
    "placement": ("cli.instances", "placement_app"),
}


def build_app(only: str | None = None) -> typer.Typer:
    """The command line with every command, or only ``only`` (the one that runs)."""
    app = typer.Typer(
        help="Shoal: run language models across a cluster, with an event log as the control plane.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    app.callback()(nats_security_options)
    for name, (module, function, options) in _COMMANDS.items():
        if only in (None, name):
            app.command(name, **options)(getattr(import_module(module), function))
    for name, (module, attribute) in _GROUPS.items():
        if only in (None, name):
            app.add_typer(getattr(import_module(module), attribute), name=name)
    return app


def invoked(argv: list[str]) -> str | None:
    """The command ``argv`` runs: its first word that names one (the options before it are
    the NATS ones, which take a value); None when it names none."""
    return next((a for a in argv if a in _COMMANDS or a in _GROUPS), None)


def main() -> None:
    try:
        build_app(invoked(sys.argv[1:]))()
    except Exception as exc:
        if not _user_error(exc):
            raise
        typer.echo(f"error: {_message(exc)}", err=True)
        sys.exit(2 if type(exc).__name__ == "ReplayError" else 1)


def _user_error(exc: Exception) -> bool:
    """An error a user can cause and fix: one line, no traceback."""
    from sqlalchemy.exc import DBAPIError

    from bus.connection import NatsUnavailable
    from bus.embedded import NatsServerError
    from bus.nats_security import NatsSecurityError
    from bus.streams import StreamSettingsError
    from projectors.database import DatabaseUrlError
    from projectors.replay import ReplayError

    errors = (
        NatsUnavailable,
        NatsServerError,
        NatsSecurityError,
        StreamSettingsError,
        DatabaseUrlError,
        ReplayError,
        DBAPIError,
    )
    return isinstance(exc, errors)


def _message(exc: Exception) -> str:
    from sqlalchemy.exc import DBAPIError

    return f"database: {exc.orig}" if isinstance(exc, DBAPIError) else str(exc)
