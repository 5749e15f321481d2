"""The node id: which machine a worker speaks for.

It is kept in ``<data_dir>/node-id`` so that a machine keeps its id across restarts: the
planner, the projection and every placement refer to nodes by id, and a restarted worker that
came back under a new id would look like a new machine while its old self timed out.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path

NODE_ID_FILE = "node-id"

# Hostnames may hold dots and other characters that subjects would have to escape; an id made
# of plain characters stays readable in `nats sub` output.
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class NodeIdError(ValueError):
    pass


def generate_node_id(hostname: str | None = None) -> str:
    """``<short hostname>-<6 hex>``: readable, and unique even when two machines share a
    hostname (cloned VMs, several workers on one machine with different data dirs)."""
    host = (hostname if hostname is not None else socket.gethostname()).split(".")[0]
    host = _UNSAFE.sub("-", host).strip("-").lower()[:40] or "node"
    return f"{host}-{secrets.token_hex(3)}"


def _validate(node_id: str) -> str:
    value = node_id.strip()
    if not value:
        raise NodeIdError("a node id must not be empty")
    if any(c.isspace() for c in value):
        raise NodeIdError(f"a node id must not contain whitespace: {node_id!r}")
    return value


def _write(path: Path, node_id: str) -> None:
    # Write then rename, so that a crash never leaves an empty or half-written id behind.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(node_id + "\n")
    tmp.replace(path)


def node_id(data_dir: Path, requested: str | None = None) -> str:
    """The node id for the worker using ``data_dir``.

    - ``requested`` given: it is used, and written so that later starts without it keep it
      (replacing a different stored id).
    - otherwise the stored id, if there is one;
    - otherwise a new id is generated and stored.
    """
    path = Path(data_dir) / NODE_ID_FILE
    if requested is not None:
        wanted = _validate(requested)
        if _read(path) != wanted:
            _write(path, wanted)
        return wanted
    stored = _read(path)
    if stored is not None:
        return stored
    new = generate_node_id()
    _write(path, new)
    return new


def _read(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    # An empty file (hand-edited, or a disk that filled up) counts as no id at all.
    return text or None


def stored_node_id(data_dir: Path) -> str | None:
    """The id a worker using ``data_dir`` has, if one ever ran there (none is made)."""
    return _read(Path(data_dir) / NODE_ID_FILE)
