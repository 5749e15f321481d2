"""The address each node advertises to the others, and why it was chosen.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"


def upgrade() -> None:
    # Nodes that joined before this said nothing of it: empty, as their events replay.
    with op.batch_alter_table("nodes") as t:
        t.add_column(sa.Column("advertised", sa.String(255), nullable=False, server_default=""))
        t.add_column(sa.Column("advertised_why", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as t:
        t.drop_column("advertised_why")
        t.drop_column("advertised")
