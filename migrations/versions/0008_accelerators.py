"""Accelerators: a device's backend, free memory, shared RAM, compute capability and the engines
that run on it; a runner's layers divided between the devices of its node.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"


def upgrade() -> None:
    # Nullable or defaulted: rows folded from older logs (a CPU, an NVIDIA gpuN) have none.
    with op.batch_alter_table("devices") as t:
        t.add_column(sa.Column("backend", sa.String(20)))
        t.add_column(sa.Column("memory_free", sa.BigInteger()))
        t.add_column(sa.Column("unified", sa.Boolean(), nullable=False, server_default=sa.false()))
        t.add_column(sa.Column("compute_capability", sa.String(20)))
        t.add_column(sa.Column("engines", sa.JSON()))
    with op.batch_alter_table("runners") as t:
        t.add_column(sa.Column("devices", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("runners") as t:
        t.drop_column("devices")
    with op.batch_alter_table("devices") as t:
        t.drop_column("engines")
        t.drop_column("compute_capability")
        t.drop_column("unified")
        t.drop_column("memory_free")
        t.drop_column("backend")
