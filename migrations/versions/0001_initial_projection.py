"""The initial projection: nodes, devices, models, instances, runners, tasks, offsets.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None

TS = sa.DateTime(timezone=True)


def _id(name: str) -> sa.Column[str]:
    return sa.Column(name, sa.String(200), primary_key=True)


def upgrade() -> None:
    op.create_table(
        "nodes",
        _id("node_id"),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("addresses", sa.JSON()),
        sa.Column("version", sa.String(50), nullable=False),
        sa.Column("joined_at", TS),
        sa.Column("left_at", TS),
        sa.Column("last_seen", TS),
        sa.Column("ram_total", sa.BigInteger(), nullable=False),
        sa.Column("ram_available", sa.BigInteger(), nullable=False),
        sa.Column("swap_total", sa.BigInteger(), nullable=False),
        sa.Column("swap_used", sa.BigInteger(), nullable=False),
        sa.Column("cpu_count", sa.Integer(), nullable=False),
        sa.Column("cpu_model", sa.String(255), nullable=False),
        sa.Column("cpu_load", sa.Float(), nullable=False),
        sa.Column("disk_free", sa.BigInteger(), nullable=False),
        sa.Column("memory_offered", sa.BigInteger(), nullable=False),
        sa.Column("interfaces", sa.JSON()),
    )
    op.create_table(
        "devices",
        _id("node_id"),
        sa.Column("device", sa.String(50), primary_key=True),
        sa.Column("kind", sa.String(10), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("memory_total", sa.BigInteger(), nullable=False),
        sa.Column("memory_used", sa.BigInteger(), nullable=False),
        sa.Column("utilisation", sa.Float()),
    )
    op.create_table(
        "models",
        _id("model_id"),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("context_length", sa.Integer(), nullable=False),
        sa.Column("engines", sa.JSON()),
        sa.Column("chat_format", sa.String(100)),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("path", sa.Text()),
        sa.Column("added_at", TS),
    )
    op.create_table(
        "instances",
        _id("instance_id"),
        sa.Column("model_id", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("placement", sa.Text()),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.Column("context_length", sa.Integer()),
        sa.Column("requested_at", TS),
        sa.Column("placed_at", TS),
        sa.Column("deleted_at", TS),
        sa.Column("placements", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("needed_bytes", sa.BigInteger()),
    )
    op.create_index("ix_instances_model_id", "instances", ["model_id"])
    op.create_table(
        "runners",
        _id("runner_id"),
        sa.Column("instance_id", sa.String(200), nullable=False),
        sa.Column("node_id", sa.String(200), nullable=False),
        sa.Column("device", sa.String(50), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("replica", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("start_layer", sa.Integer(), nullable=False),
        sa.Column("end_layer", sa.Integer(), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("tensor_split", sa.JSON()),
        sa.Column("progress", sa.Float()),
        sa.Column("error", sa.Text()),
        sa.Column("exit_code", sa.Integer()),
        sa.Column("endpoint", sa.String(255)),
        sa.Column("pid", sa.Integer()),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_failed_at", TS),
        sa.Column("updated_at", TS),
    )
    op.create_index("ix_runners_instance_id", "runners", ["instance_id"])
    op.create_index("ix_runners_node_id", "runners", ["node_id"])
    op.create_table(
        "tasks",
        _id("task_id"),
        sa.Column("model_id", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("user", sa.String(255)),
        sa.Column("max_tokens", sa.Integer()),
        sa.Column("created_at", TS),
        sa.Column("started_at", TS),
        sa.Column("finished_at", TS),
        sa.Column("runner_id", sa.String(200)),
        sa.Column("instance_id", sa.String(200)),
        sa.Column("prompt_tokens", sa.Integer()),
        sa.Column("completion_tokens", sa.Integer()),
        sa.Column("ttft_ms", sa.Float()),
        sa.Column("tokens_per_s", sa.Float()),
        sa.Column("total_ms", sa.Float()),
        sa.Column("finish_reason", sa.String(20)),
        sa.Column("error", sa.Text()),
    )
    op.create_index("ix_tasks_created_at", "tasks", ["created_at"])
    op.create_index("ix_tasks_status", "tasks", ["status"])
    op.create_table(
        "projector_offsets",
        sa.Column("projector", sa.String(100), primary_key=True),
        sa.Column("stream", sa.String(100), primary_key=True),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    for table in ("projector_offsets", "tasks", "runners", "instances", "models", "devices"):
        op.drop_table(table)
    op.drop_table("nodes")
