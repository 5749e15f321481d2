"""The token of a `shoal up` whose API has keys: its embedded NATS authenticates even on
loopback, or any user of the machine could publish ``KeyAdded role=admin`` or read every answer
on ``shoal.chunks.>``.

The token is made once and kept in the data directory (``nats/token``, mode 0600), and
registered for its port in the user's own run directory (``~/.shoal/run``, mode 0700), so that
the user's other commands on this machine (``shoal keys add``, ``shoal api --nats ...``) find
it for a loopback URL without being told (``bus/connection.py``); another user can read
neither. A server that asks no credentials ignores a token it is sent, so a stale registration
costs nothing; the registration is removed when `shoal up` stops.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_FILE = "token"


def run_dir() -> Path:
    return Path.home() / ".shoal" / "run"


def _private_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)  # an older file's mode too


def data_token(nats_dir: Path) -> str:
    """The token kept in ``nats_dir`` (made on first use, mode 0600)."""
    path = nats_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if not token:
        token = secrets.token_urlsafe(32)
        _private_write(path, token)
    return token


def register(port: int, token: str) -> Path:
    """Let this user's commands find ``token`` for a loopback NATS on ``port``."""
    directory = run_dir()
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    path = directory / f"nats-{port}.token"
    _private_write(path, token)
    return path


def unregister(port: int) -> None:
    """The server on ``port`` stopped: its token is no longer this user's to find there."""
    (run_dir() / f"nats-{port}.token").unlink(missing_ok=True)


def registered(url: str) -> str | None:
    """The token this user's `shoal up` registered for ``url`` (a single loopback server);
    None when there is none, or the URL names another host or several servers."""
    if "," in url:
        return None
    try:
        split = urlsplit(url)
        host, port = split.hostname, split.port
    except ValueError:
        return None
    if host is None or not _loopback(host):
        return None
    try:
        token = (run_dir() / f"nats-{port or 4222}.token").read_text().strip()
    except OSError:
        return None
    return token or None


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
