"""Instances serve a role (chat or embeddings) and may be called by other names (aliases).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"


def upgrade() -> None:
    with op.batch_alter_table("instances") as t:
        t.add_column(sa.Column("role", sa.String(20), nullable=False, server_default="chat"))
        t.add_column(sa.Column("aliases", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("instances") as t:
        t.drop_column("aliases")
        t.drop_column("role")
