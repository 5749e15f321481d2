"""Alembic environment. Shoal runs migrations programmatically (``projectors.database.upgrade``),
handing over an open connection; there is no alembic.ini to keep in step."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from projectors.tables import metadata

connection: Connection | None = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `shoal db upgrade --db URL`")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
