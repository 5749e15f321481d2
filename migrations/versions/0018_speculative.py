"""Speculative decoding: what an instance asked for its runners (none on older logs).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"


def upgrade() -> None:
    with op.batch_alter_table("instances") as t:
        t.add_column(sa.Column("speculative", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("instances") as t:
        t.drop_column("speculative")
