"""API keys with roles, what each key made (its owner), and what each key used.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Nullable: what was made before keys had owners has none (it was made without a key).
    with op.batch_alter_table("tasks") as t:
        t.add_column(sa.Column("owner", sa.String(200), nullable=True))
        t.create_index("ix_tasks_owner", ["owner"])
    with op.batch_alter_table("responses") as t:
        t.add_column(sa.Column("owner", sa.String(200), nullable=True))
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(200), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("role", sa.String(20), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("requests_per_minute", sa.Integer()),
        sa.Column("tokens_per_minute", sa.Integer()),
        sa.Column("added_at", TS),
        sa.Column("revoked_at", TS),
    )
    op.create_table(
        "key_usage",
        sa.Column("key_id", sa.String(200), primary_key=True),
        sa.Column("model_id", sa.String(200), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("key_usage")
    op.drop_table("api_keys")
    with op.batch_alter_table("responses") as t:
        t.drop_column("owner")
    with op.batch_alter_table("tasks") as t:
        t.drop_index("ix_tasks_owner")
        t.drop_column("owner")
