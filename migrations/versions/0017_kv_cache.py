"""KV-cache types: the type an instance asked for (or auto) and the one it was placed with.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"


def upgrade() -> None:
    # Rows folded from older logs were served with llama.cpp's default, f16.
    with op.batch_alter_table("instances") as t:
        t.add_column(
            sa.Column("requested_kv_cache", sa.String(10), nullable=False, server_default="f16")
        )
        t.add_column(sa.Column("kv_cache", sa.String(10), nullable=False, server_default="f16"))


def downgrade() -> None:
    with op.batch_alter_table("instances") as t:
        t.drop_column("kv_cache")
        t.drop_column("requested_kv_cache")
