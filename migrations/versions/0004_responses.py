"""Stored responses of the Responses API (``ResponseStored``, ``ResponseDeleted``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("response_id", sa.String(200), primary_key=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("model_id", sa.String(200), nullable=False),
        sa.Column("created_at", TS),
        sa.Column("updated_at", TS),
        sa.Column("deleted_at", TS),
        sa.Column("response", sa.JSON()),
        sa.Column("input_items", sa.JSON()),
        sa.Column("conversation", sa.JSON()),
    )


def downgrade() -> None:
    op.drop_table("responses")
