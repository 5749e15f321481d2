"""Instances loaded on demand: whether one was, its keep-alive, when it was last used.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"


def upgrade() -> None:
    # Every instance before this was asked for explicitly: pinned.
    with op.batch_alter_table("instances") as t:
        t.add_column(
            sa.Column("on_demand", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        t.add_column(sa.Column("keep_alive_s", sa.Float(), nullable=True))
        t.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("instances") as t:
        t.drop_column("last_used_at")
        t.drop_column("keep_alive_s")
        t.drop_column("on_demand")
