"""The tracking row keeps a digest of the event it applied at its sequence.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"


def upgrade() -> None:
    # Rows written before this keep none: only the sequence is checked for them, until the
    # next batch writes one.
    with op.batch_alter_table("projector_offsets") as t:
        t.add_column(sa.Column("last_digest", sa.String(32), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("projector_offsets") as t:
        t.drop_column("last_digest")
