"""Task resumes: how often a task was continued after the runner serving it was lost.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"


def upgrade() -> None:
    # Rows folded from older logs were never resumed.
    with op.batch_alter_table("tasks") as t:
        t.add_column(sa.Column("resumes", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as t:
        t.drop_column("resumes")
