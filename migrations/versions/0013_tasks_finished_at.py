"""An index on when a task ended: a planner forgets the tasks that ended longest ago.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"


def upgrade() -> None:
    op.create_index("ix_tasks_finished_at", "tasks", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_tasks_finished_at", table_name="tasks")
