"""Shared models: a model's weight files in the models bucket, and the node of a local one.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"


def upgrade() -> None:
    # Nullable: a model added before the bucket has its weights at a path, on any node.
    with op.batch_alter_table("models") as t:
        t.add_column(sa.Column("files", sa.JSON(), nullable=True))
        t.add_column(sa.Column("node_id", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as t:
        t.drop_column("node_id")
        t.drop_column("files")
