"""`shoal keys ...`: API keys with roles, made and revoked on the log (api/keys.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import select

from api.keys import key_digest, new_key
from bus.connection import connect
from bus.publisher import Publisher
from cli.options import DEFAULT_DB, DEFAULT_NATS, DbUrl, NatsUrl
from events.catalogue import KeyAdded, KeyRevoked, new_id
from events.kinds import KEY_ROLES, KeyRole
from projectors import database
from projectors.rows import KeyRow, UsageRow
from projectors.tables import api_keys, key_usage

app = typer.Typer(help="API keys: who may call the API, and as what.", no_args_is_help=True)

ORIGIN = f"shoal-cli@{socket.gethostname()}"


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


async def _keys(db: str) -> tuple[list[KeyRow], list[UsageRow]]:
    engine = database.create_engine(db)
    try:
        await database.upgrade(engine)
        async with engine.connect() as conn:
            keys = [KeyRow(**r) for r in (await conn.execute(select(api_keys))).mappings()]
            usage = [UsageRow(**r) for r in (await conn.execute(select(key_usage))).mappings()]
    finally:
        await engine.dispose()
    return keys, usage


async def _publish(nats: str, event: KeyAdded | KeyRevoked) -> None:
    nc = await connect(nats, name="shoal-keys")
    try:
        await Publisher(nc.jetstream()).publish(event)
    finally:
        await nc.close()


@app.command()
def add(
    name: Annotated[str, typer.Argument(help="Whose key it is (a person, a service).")],
    role: Annotated[str, typer.Option(help="user: inference only; admin: everything.")] = "user",
    requests_per_minute: Annotated[
        int | None, typer.Option(min=1, help="The most requests a minute (default: any).")
    ] = None,
    tokens_per_minute: Annotated[
        int | None, typer.Option(min=1, help="The most tokens a minute (default: any).")
    ] = None,
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
) -> None:
    """Make an API key: printed once, kept nowhere (the log has its SHA-256)."""
    if role not in KEY_ROLES:
        _fail(f"--role is one of {', '.join(KEY_ROLES)}, not {role!r}")
    keys, _ = asyncio.run(_keys(db))
    if any(k.name == name and k.revoked_at is None for k in keys):
        _fail(f"a key named {name!r} exists: revoke it first, or choose another name")
    key = new_key()
    chosen: KeyRole = "admin" if role == "admin" else "user"
    event = KeyAdded(
        key_id=new_id(),
        origin=ORIGIN,
        name=name,
        role=chosen,
        digest=key_digest(key),
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
    )
    asyncio.run(_publish(nats, event))
    typer.echo(key)
    typer.echo(
        f"(key {event.key_id}, {chosen}, for {name}: shown this once; the API takes it as"
        " `Authorization: Bearer <key>` or `x-api-key`)",
        err=True,
    )


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="The key's name or id.")],
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
) -> None:
    """Revoke a key: it opens nothing any more (within a second on every API process)."""
    keys, _ = asyncio.run(_keys(db))
    live = [k for k in keys if k.revoked_at is None and name in (k.name, k.key_id)]
    if not live:
        _fail(f"no key {name!r} that is not revoked (see `shoal keys list`)")
    for k in live:
        asyncio.run(_publish(nats, KeyRevoked(key_id=k.key_id, origin=ORIGIN)))
        typer.echo(f"revoked {k.name} ({k.key_id})")


@app.command("list")
def list_keys(
    db: DbUrl = DEFAULT_DB,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per key.")] = False,
) -> None:
    """Keys, their roles and limits, and the tokens each used."""
    keys, usage = asyncio.run(_keys(db))
    totals: dict[str, dict[str, int]] = {}
    for u in usage:
        t = totals.setdefault(u.key_id, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        t["requests"] += u.requests
        t["prompt_tokens"] += u.prompt_tokens
        t["completion_tokens"] += u.completion_tokens
    rows: list[dict[str, Any]] = [
        {
            "key_id": k.key_id,
            "name": k.name,
            "role": k.role,
            "requests_per_minute": k.requests_per_minute,
            "tokens_per_minute": k.tokens_per_minute,
            "added_at": k.added_at.isoformat() if k.added_at else None,
            "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
            **totals.get(k.key_id, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}),
        }
        for k in sorted(keys, key=lambda k: (k.revoked_at is not None, k.name))
    ]
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table("name", "role", "id", "limits", "requests", "tokens in/out", "revoked")
    for r in rows:
        limits = "/".join(
            f"{v} {what}/min"
            for v, what in ((r["requests_per_minute"], "req"), (r["tokens_per_minute"], "tok"))
            if v
        )
        table.add_row(
            r["name"],
            r["role"],
            r["key_id"],
            limits or "-",
            str(r["requests"]),
            f"{r['prompt_tokens']}/{r['completion_tokens']}",
            r["revoked_at"] or "",
        )
    Console().print(table)
