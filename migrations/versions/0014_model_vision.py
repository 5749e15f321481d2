"""Whether an MLX model reads images (its directory holds a vision tower).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"


def upgrade() -> None:
    # Every model before this read images only through a projector file: none is MLX vision.
    with op.batch_alter_table("models") as t:
        t.add_column(sa.Column("vision", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("models") as t:
        t.drop_column("vision")
