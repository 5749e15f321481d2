"""Events by type, counted by the projector as it applies them (for /metrics).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"


def upgrade() -> None:
    # Empty: a projection made before counts from here on (a replay counts the whole log).
    op.create_table(
        "projector_event_counts",
        sa.Column("projector", sa.String(100), primary_key=True),
        sa.Column("stream", sa.String(100), primary_key=True),
        sa.Column("type", sa.String(100), primary_key=True),
        sa.Column("events", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("projector_event_counts")
