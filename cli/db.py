"""`shoal db ...`: the projection database's schema."""

from __future__ import annotations

import asyncio

import typer

from cli.options import DEFAULT_DB, DbUrl
from projectors import database

app = typer.Typer(help="The projection database.", no_args_is_help=True)


@app.command()
def upgrade(db: DbUrl = DEFAULT_DB) -> None:
    """Create or migrate the projection schema to the latest revision."""

    async def main() -> str | None:
        engine = database.create_engine(db)
        try:
            await database.upgrade(engine)
            return await database.current_revision(engine)
        finally:
            await engine.dispose()

    typer.echo(f"database at revision {asyncio.run(main())}")
