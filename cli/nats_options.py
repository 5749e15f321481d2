"""`shoal --nats-token ... COMMAND`: NATS authentication and TLS options for every command.

They only set the ``SHOAL_NATS_*`` environment variables (``bus/nats_security.py``), which every
connection reads and which processes started from here (a worker's runners) inherit. Secrets
given as options are visible to other users of the machine (``ps``): prefer the variables, or
files (``--nats-nkey``, ``--nats-creds``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from bus.nats_security import ENV, NatsSecurity

_FILE = {"exists": True, "dir_okay": False}


def nats_security_options(
    nats_token: Annotated[
        str | None,
        typer.Option(
            envvar=ENV["token"],
            help="Authenticate to NATS with this token.",
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
            help="The NATS user's password.",
        ),
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
