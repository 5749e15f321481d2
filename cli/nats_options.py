"""`shoal --nats-token ... COMMAND`: NATS authentication and TLS options for every command.

They only set the ``SHOAL_NATS_*`` environment variables (``bus/nats_security.py``), which every
connection reads and which processes started from here (a worker's runners) inherit. Secrets
given as options are visible to other users of the machine (``ps``), and are warned about:
prefer the variables, or files (``--nats-token-file``, ``--nats-password-file``,
``--nats-nkey``, ``--nats-creds``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from bus.nats_security import ENV, NatsSecurity

_FILE = {"exists": True, "dir_okay": False}


def _secret(given: str | None, path: Path | None, option: str) -> str | None:
    """A secret given as text, or read from a file (its first line)."""
    if path is None:
        return given
    try:
        lines = path.read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None
    if not lines or not lines[0].strip():
        raise typer.BadParameter(f"{path} is empty", param_hint=option)
    return lines[0].strip()


def nats_security_options(
    ctx: typer.Context,
    nats_token: Annotated[
        str | None,
        typer.Option(
            envvar=ENV["token"],
            help="Authenticate to NATS with this token (seen by every user in the process"
            " list: prefer --nats-token-file or the variable).",
            show_envvar=True,
        ),
    ] = None,
    nats_user: Annotated[
        str | None,
        typer.Option(
            envvar=ENV["user"],
            help="Authenticate to NATS as this user (with --nats-password).",
        ),
    ] = None,
    nats_password: Annotated[
        str | None,
        typer.Option(
            envvar=ENV["password"],
            help="The NATS user's password (seen in the process list: prefer"
            " --nats-password-file or the variable).",
        ),
    ] = None,
    nats_token_file: Annotated[
        Path | None,
        typer.Option(help="A file holding the NATS token (readable by you alone).", **_FILE),
    ] = None,
    nats_password_file: Annotated[
        Path | None,
        typer.Option(help="A file holding the NATS user's password.", **_FILE),
    ] = None,
    nats_nkey: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV["nkey_seed_file"],
            help="File with an nkey seed to authenticate with.",
            **_FILE,
        ),
    ] = None,
    nats_creds: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV["creds_file"],
            help="NATS credentials file (JWT + seed).",
            **_FILE,
        ),
    ] = None,
    nats_ca: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV["tls_ca"],
            help="CA certificate that signed the NATS server's: use TLS.",
            **_FILE,
        ),
    ] = None,
    nats_cert: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV["tls_cert"],
            help="Client certificate for NATS (mutual TLS).",
            **_FILE,
        ),
    ] = None,
    nats_key: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV["tls_key"],
            help="Key of the client certificate.",
            **_FILE,
        ),
    ] = None,
) -> None:
    """Shoal: run language models across a cluster, with an event log as the control plane."""
    for option, instead in (
        ("nats_token", "--nats-token-file or SHOAL_NATS_TOKEN"),
        ("nats_password", "--nats-password-file or SHOAL_NATS_PASSWORD"),
    ):
        source = ctx.get_parameter_source(option)
        if source is not None and source.name == "COMMANDLINE":
            flag = "--" + option.replace("_", "-")
            typer.echo(
                f"warning: {flag} puts a secret in this process's command line, which every"
                f" user of the machine can read (ps): use {instead}",
                err=True,
            )
    nats_token = _secret(nats_token, nats_token_file, "--nats-token-file")
    nats_password = _secret(nats_password, nats_password_file, "--nats-password-file")
    given = {
        "token": nats_token,
        "user": nats_user,
        "password": nats_password,
        "nkey_seed_file": nats_nkey,
        "creds_file": nats_creds,
        "tls_ca": nats_ca,
        "tls_cert": nats_cert,
        "tls_key": nats_key,
    }
    for field, value in given.items():
        if value is not None:
            os.environ[ENV[field]] = str(value.absolute() if isinstance(value, Path) else value)
    NatsSecurity.from_env()  # settings that cannot work together: a clear error now
