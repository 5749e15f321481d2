"""Slots: how many tasks an instance's runners serve at once (asked for, placed, reported).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"


def upgrade() -> None:
    # Nullable: rows folded from older logs have no slots, which means one.
    with op.batch_alter_table("instances") as t:
        t.add_column(sa.Column("requested_slots", sa.Integer()))
        t.add_column(sa.Column("slots", sa.Integer()))
    with op.batch_alter_table("runners") as t:
        t.add_column(sa.Column("slots", sa.Integer()))


def downgrade() -> None:
    with op.batch_alter_table("runners") as t:
        t.drop_column("slots")
    with op.batch_alter_table("instances") as t:
        t.drop_column("slots")
        t.drop_column("requested_slots")
