"""What the planner needs: model footprints, heartbeat intervals, decision generations, and
the recent failures of runners.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"


def upgrade() -> None:
    # batch_alter_table: SQLite cannot add NOT NULL columns in place on every version.
    with op.batch_alter_table("nodes") as t:
        t.add_column(sa.Column("heartbeat_s", sa.Float()))
    with op.batch_alter_table("models") as t:
        t.add_column(
            sa.Column("kv_bytes_per_token", sa.BigInteger(), nullable=False, server_default="0")
        )
        t.add_column(
            sa.Column("overhead_bytes", sa.BigInteger(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("instances") as t:
        t.add_column(sa.Column("generation", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("avoid", sa.JSON()))
    with op.batch_alter_table("runners") as t:
        t.add_column(sa.Column("failure_times", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("runners") as t:
        t.drop_column("failure_times")
    with op.batch_alter_table("instances") as t:
        t.drop_column("avoid")
        t.drop_column("generation")
    with op.batch_alter_table("models") as t:
        t.drop_column("overhead_bytes")
        t.drop_column("kv_bytes_per_token")
    with op.batch_alter_table("nodes") as t:
        t.drop_column("heartbeat_s")
