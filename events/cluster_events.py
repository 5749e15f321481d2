"""The events of the cluster itself: its nodes, the models it has, the instances placed and
their runners, and the API keys. Part of the catalogue (``catalogue.py``), which importers use.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, ClassVar

from pydantic import Field

from events.event_base import EventBase
from events.kinds import (
    DEFAULT_ENGINE,
    DEFAULT_KV_CACHE,
    Engine,
    InstanceRole,
    KeyRole,
    KvCacheRequest,
    KvCacheType,
)
from events.records import Id, Int32, NodeProfile, ShardAssignment, Speculative, WeightFile
from events.states import RunnerState
from events.subjects import Aggregate

# --- nodes --------------------------------------------------------------------------------


class _NodeEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "node"
    subject_fields: ClassVar[tuple[str, ...]] = ("node_id",)
    node_id: Id


class NodeJoined(_NodeEvent):
    """A worker started on a machine and joined the cluster."""

    hostname: str = ""
    addresses: list[str] = Field(default_factory=list, description="Data-plane addresses.")
    version: str = ""
    heartbeat_s: float | None = Field(
        default=None, description="Seconds between its ResourceProfiled heartbeats."
    )
    advertised: str = Field(
        default="",
        description="The address other nodes reach this one's pipeline stages and weights at.",
    )
    advertised_why: str = Field(default="", description="Why that address was chosen.")


class NodeLeft(_NodeEvent):
    """A worker stopped cleanly."""

    reason: str = "shutdown"


class NodeTimedOut(_NodeEvent):
    """A node's heartbeats stopped; decided by a planner."""

    last_seen: datetime
    missed_heartbeats: int


class ResourceProfiled(_NodeEvent):
    """The node's resources; sent periodically, so it is also the heartbeat."""

    profile: NodeProfile


# --- models -------------------------------------------------------------------------------


class ModelAdded(EventBase):
    """A model became known to the cluster, with what placement needs to know."""

    aggregate: ClassVar[Aggregate] = "model"
    subject_fields: ClassVar[tuple[str, ...]] = ("model_id",)
    model_id: Id
    family: str = ""
    n_layers: int
    context_length: int = 0
    size_bytes: int
    engines: list[Engine] = Field(default_factory=lambda: [DEFAULT_ENGINE])
    chat_format: str | None = None
    source: str = Field(default="", description="Where the weights come from (package, repo).")
    path: str | None = Field(
        default=None,
        description="The weights on the disk of `node_id` (or of every node, in"
        " a log from before `files`): a GGUF file or an MLX directory.",
    )
    kv_bytes_per_token: int = Field(
        default=0, description="KV cache per token of context, all layers (f16)."
    )
    overhead_bytes: int = Field(
        default=0, description="Engine memory beyond weights and KV cache, per runner."
    )
    files: list[WeightFile] = Field(
        default_factory=list,
        description="The weights, by content: each node that runs a shard of the model takes"
        " what it needs from a node that holds them, else from the models bucket. Empty: they"
        " are at `path` (added with --local, or before the bucket).",
    )
    node_id: str | None = Field(
        default=None,
        description="The node whose disk holds `path` (added with --local): the only one that"
        " serves the model. None: any node.",
    )
    vision: bool = Field(
        default=False,
        description="An MLX model that reads images (its directory holds a vision tower, read"
        " with mlx-vlm). A GGUF model reads them when one of its `files` is a projector.",
    )


class ModelRemoved(EventBase):
    """A model the cluster knew is no longer known (``shoal models remove``, Ollama's DELETE),
    asked for when no live instance used it. The objects of the models bucket that no other
    model names go with it; it may be added again."""

    aggregate: ClassVar[Aggregate] = "model"
    subject_fields: ClassVar[tuple[str, ...]] = ("model_id",)
    model_id: Id
    reason: str = Field(default="", description="Who asked: the command or the API route.")


class ModelEvicted(EventBase):
    """A node's worker deleted a model's files from its weights cache to stay within the
    cache's size budget (the model stays known: a runner fetches them again if it needs
    them)."""

    aggregate: ClassVar[Aggregate] = "node"
    subject_fields: ClassVar[tuple[str, ...]] = ("node_id", "model_id")
    node_id: Id
    model_id: Id
    bytes_freed: int = Field(
        ge=0, description="Bytes of the cache's own copies deleted (links to files cost none)."
    )
    budget_bytes: int = Field(ge=0, description="The cache's size budget.")
    reason: str = Field(default="", description="What the room was made for.")


# --- instances ----------------------------------------------------------------------------


class _InstanceEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "instance"
    subject_fields: ClassVar[tuple[str, ...]] = ("instance_id",)
    instance_id: Id


class InstanceRequested(_InstanceEvent):
    """Someone asked for a model to be served."""

    model_id: Id
    placement: str | None = Field(default=None, description="Manual placement spec (JSON).")
    replicas: Int32 = 1
    context_length: Int32 | None = None
    slots: Int32 | None = Field(
        default=None,
        description="Tasks each replica serves at once (a KV cache of context_length each);"
        " None: as many as fit, up to 8, chosen at placement.",
    )
    role: InstanceRole = "chat"
    kv_cache: KvCacheRequest = Field(
        default=DEFAULT_KV_CACHE,
        description="The KV cache's type (f16, q8_0, q4_0), or auto: placement picks f16, else"
        " the smallest that lets the context fit.",
    )
    speculative: Speculative | None = Field(
        default=None,
        description="Speculative decoding for its runners (prompt lookup); None: none.",
    )
    aliases: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        description="Other names clients may call the model by (an SDK's own model names).",
    )
    on_demand: bool = Field(
        default=False,
        description="Asked for by a request for a model nothing served: unloaded once idle"
        " past its keep-alive, or to make room. False: pinned (asked for explicitly).",
    )
    keep_alive_s: float | None = Field(
        default=None,
        description="An on-demand instance's seconds idle before it is unloaded (negative:"
        " never); None: the planner's default.",
    )
    reason: str = Field(default="", description="Why it was asked for (the request's route).")


class InstancePlaced(_InstanceEvent):
    """A planner decided where an instance's shards run. A later one replaces the earlier."""

    model_id: Id
    shards: list[ShardAssignment]
    generation: int | None = Field(
        default=None,
        description="The instance's decision number (1, 2...); a decision for a generation"
        " that is no longer next is ignored, so two planners never both count.",
    )
    reason: str = Field(default="", description="Why it was placed again, when it was.")
    avoid: list[str] = Field(
        default_factory=list, description="'node:device's its runners kept failing on."
    )
    slots: Int32 | None = Field(
        default=None,
        description="Tasks each replica serves at once, as placed (memory counted for the KV"
        " cache of each); None (older logs): 1.",
    )
    kv_cache: KvCacheType = Field(
        default=DEFAULT_KV_CACHE,
        description="The KV cache's type its runners use, as placed (older logs: f16).",
    )


class PlacementRejected(_InstanceEvent):
    """A planner found no way to place an instance; the reason says what was missing."""

    model_id: Id
    reason: str
    needed_bytes: int | None = None
    available_bytes: dict[str, int] = Field(
        default_factory=dict, description="Usable bytes per 'node:device'."
    )
    generation: int | None = Field(default=None, description="As in InstancePlaced.")
    avoid: list[str] = Field(default_factory=list, description="As in InstancePlaced.")


class InstanceDeleteRequested(_InstanceEvent):
    """Someone asked for an instance to stop being served."""

    reason: str = ""


class InstanceDeleted(_InstanceEvent):
    """An instance is gone; its runners stop."""

    reason: str = ""


# --- runners ------------------------------------------------------------------------------


class RunnerStateChanged(EventBase):
    """A runner process (one shard) changed state."""

    aggregate: ClassVar[Aggregate] = "runner"
    subject_fields: ClassVar[tuple[str, ...]] = ("runner_id",)
    runner_id: Id
    instance_id: Id
    node_id: Id
    state: RunnerState
    progress: float | None = Field(default=None, description="0-1 while Downloading/Loading.")
    error: str | None = None
    exit_code: int | None = None
    endpoint: str | None = Field(default=None, description="Data-plane endpoint (host:port).")
    pid: int | None = None
    slots: Int32 | None = Field(
        default=None, description="On Ready: how many tasks the runner serves at once."
    )


# --- API keys -----------------------------------------------------------------------------


class _KeyEvent(EventBase):
    aggregate: ClassVar[Aggregate] = "key"
    subject_fields: ClassVar[tuple[str, ...]] = ("key_id",)
    key_id: Id


class KeyAdded(_KeyEvent):
    """An API key was made (``shoal keys add``). The key itself is never on the log: only its
    digest, which the API compares with a digest of the key a request sends."""

    name: Annotated[str, Field(min_length=1, max_length=100)]
    role: KeyRole = "user"
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, hex.")
    requests_per_minute: Int32 | None = Field(
        default=None, description="The most requests it may make in a minute (None: any)."
    )
    tokens_per_minute: Int32 | None = Field(
        default=None, description="The most tokens (prompt and generated) in a minute."
    )


class KeyRevoked(_KeyEvent):
    """An API key no longer opens anything."""

    reason: str = ""
