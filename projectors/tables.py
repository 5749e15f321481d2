"""The projection's SQL schema (SQLAlchemy Core). Created only by Alembic migrations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    false,
)


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


metadata = MetaData()


def _id(name: str) -> Column[str]:
    return Column(name, String(200), primary_key=True)


nodes = Table(
    "nodes",
    metadata,
    _id("node_id"),
    Column("status", String(20), nullable=False),
    Column("hostname", String(255), nullable=False),
    Column("addresses", JSON),
    Column("version", String(50), nullable=False),
    Column("joined_at", UtcDateTime),
    Column("left_at", UtcDateTime),
    Column("last_seen", UtcDateTime),
    Column("ram_total", BigInteger, nullable=False),
    Column("ram_available", BigInteger, nullable=False),
    Column("swap_total", BigInteger, nullable=False),
    Column("swap_used", BigInteger, nullable=False),
    Column("cpu_count", Integer, nullable=False),
    Column("cpu_model", String(255), nullable=False),
    Column("cpu_load", Float, nullable=False),
    Column("disk_free", BigInteger, nullable=False),
    Column("memory_offered", BigInteger, nullable=False),
    Column("interfaces", JSON),
    Column("heartbeat_s", Float),
    Column("advertised", String(255), nullable=False),
    Column("advertised_why", Text, nullable=False),
)

devices = Table(
    "devices",
    metadata,
    _id("node_id"),
    Column("device", String(50), primary_key=True),
    Column("kind", String(10), nullable=False),
    Column("name", String(255), nullable=False),
    Column("memory_total", BigInteger, nullable=False),
    Column("memory_used", BigInteger, nullable=False),
    Column("utilisation", Float),
    Column("backend", String(20)),
    Column("memory_free", BigInteger),
    Column("unified", Boolean, nullable=False, server_default=false()),
    Column("compute_capability", String(20)),
    Column("engines", JSON),
)

models = Table(
    "models",
    metadata,
    _id("model_id"),
    Column("n_layers", Integer, nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("family", String(100), nullable=False),
    Column("context_length", Integer, nullable=False),
    Column("engines", JSON),
    Column("chat_format", String(100)),
    Column("source", Text, nullable=False),
    Column("path", Text),
    Column("added_at", UtcDateTime),
    Column("kv_bytes_per_token", BigInteger, nullable=False),
    Column("overhead_bytes", BigInteger, nullable=False),
    Column("files", JSON),
    Column("node_id", String(200)),
    Column("vision", Boolean, nullable=False, server_default=false()),
)

instances = Table(
    "instances",
    metadata,
    _id("instance_id"),
    Column("model_id", String(200), nullable=False, index=True),
    Column("status", String(20), nullable=False),
    Column("placement", Text),
    Column("replicas", Integer, nullable=False),
    Column("context_length", Integer),
    Column("requested_at", UtcDateTime),
    Column("placed_at", UtcDateTime),
    Column("deleted_at", UtcDateTime),
    Column("placements", Integer, nullable=False),
    Column("reason", Text),
    Column("needed_bytes", BigInteger),
    Column("generation", Integer, nullable=False),
    Column("avoid", JSON),
    Column("role", String(20), nullable=False, server_default="chat"),
    Column("aliases", JSON),
    Column("requested_slots", Integer),
    Column("slots", Integer),
    Column("requested_kv_cache", String(10), nullable=False, server_default="f16"),
    Column("kv_cache", String(10), nullable=False, server_default="f16"),
    Column("speculative", JSON),
    Column("on_demand", Boolean, nullable=False, server_default=false()),
    Column("keep_alive_s", Float),
    Column("last_used_at", UtcDateTime),
)

runners = Table(
    "runners",
    metadata,
    _id("runner_id"),
    Column("instance_id", String(200), nullable=False, index=True),
    Column("node_id", String(200), nullable=False, index=True),
    Column("device", String(50), nullable=False),
    Column("state", String(20), nullable=False),
    Column("replica", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("world_size", Integer, nullable=False),
    Column("start_layer", Integer, nullable=False),
    Column("end_layer", Integer, nullable=False),
    Column("n_layers", Integer, nullable=False),
    Column("tensor_split", JSON),
    Column("progress", Float),
    Column("error", Text),
    Column("exit_code", Integer),
    Column("endpoint", String(255)),
    Column("pid", Integer),
    Column("failures", Integer, nullable=False),
    Column("last_failed_at", UtcDateTime),
    Column("updated_at", UtcDateTime),
    Column("failure_times", JSON),
    Column("slots", Integer),
    Column("devices", JSON),
)

tasks = Table(
    "tasks",
    metadata,
    _id("task_id"),
    Column("model_id", String(200), nullable=False),
    Column("status", String(20), nullable=False),
    Column("kind", String(20), nullable=False),
    Column("user", String(255)),
    Column("max_tokens", Integer),
    Column("created_at", UtcDateTime),
    Column("started_at", UtcDateTime),
    Column("finished_at", UtcDateTime),
    Column("runner_id", String(200)),
    Column("instance_id", String(200)),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("ttft_ms", Float),
    Column("tokens_per_s", Float),
    Column("total_ms", Float),
    Column("finish_reason", String(20)),
    Column("error", Text),
    Column("resumes", Integer, nullable=False, server_default="0"),
    Column("owner", String(200)),
    Index("ix_tasks_created_at", "created_at"),
    Index("ix_tasks_finished_at", "finished_at"),
    Index("ix_tasks_owner", "owner"),
    Index("ix_tasks_status", "status"),
)

responses = Table(
    "responses",
    metadata,
    _id("response_id"),
    Column("status", String(20), nullable=False),
    Column("task_id", String(200), nullable=False),
    Column("model_id", String(200), nullable=False),
    Column("created_at", UtcDateTime),
    Column("updated_at", UtcDateTime),
    Column("deleted_at", UtcDateTime),
    Column("response", JSON),
    Column("input_items", JSON),
    Column("conversation", JSON),
    Column("conversation_ref", JSON),
    Column("input_items_ref", JSON),
    Column("expires_at", UtcDateTime),
    Column("owner", String(200)),
)

api_keys = Table(
    "api_keys",
    metadata,
    _id("key_id"),
    Column("name", String(100), nullable=False),
    Column("role", String(20), nullable=False),
    Column("digest", String(64), nullable=False),
    Column("requests_per_minute", Integer),
    Column("tokens_per_minute", Integer),
    Column("added_at", UtcDateTime),
    Column("revoked_at", UtcDateTime),
)

key_usage = Table(
    "key_usage",
    metadata,
    Column("key_id", String(200), primary_key=True),
    Column("model_id", String(200), primary_key=True),
    Column("requests", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("cached_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
)

# Where each projector stands in each stream: written in the same transaction as the rows.
projector_offsets = Table(
    "projector_offsets",
    metadata,
    Column("projector", String(100), primary_key=True),
    Column("stream", String(100), primary_key=True),
    Column("last_seq", BigInteger, nullable=False),
    # A digest of the message at last_seq (bus/log_position.py): a log that lost its tail and
    # gave the number to a newer event is told from the one applied. "" when unknown.
    Column("last_digest", String(32), nullable=False, server_default=""),
)

# What the log holds by event type, up to the projector's tracking row (the subject names the
# type, so malformed events count too): written in the same transaction, for /metrics.
event_counts = Table(
    "projector_event_counts",
    metadata,
    Column("projector", String(100), primary_key=True),
    Column("stream", String(100), primary_key=True),
    Column("type", String(100), primary_key=True),
    Column("events", BigInteger, nullable=False),
)

STATE_TABLES: dict[str, Table] = {
    t.name: t
    for t in (nodes, devices, models, instances, runners, tasks, responses, api_keys, key_usage)
}
