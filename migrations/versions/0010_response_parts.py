"""Stored responses name their conversation and input items as parts (stored once, by digest),
and expire.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"


def upgrade() -> None:
    # Nullable: a response stored before parts holds its conversation itself, and never expires.
    with op.batch_alter_table("responses") as t:
        t.add_column(sa.Column("conversation_ref", sa.JSON(), nullable=True))
        t.add_column(sa.Column("input_items_ref", sa.JSON(), nullable=True))
        t.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("responses") as t:
        t.drop_column("expires_at")
        t.drop_column("input_items_ref")
        t.drop_column("conversation_ref")
