"""Rows of the projection, as plain immutable values.

The pure rules (``rules/``) read and produce these; ``tables.py`` stores them with the same
column names (a test keeps the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from events.kinds import InstanceRole, KeyRole, KvCacheRequest, KvCacheType
from events.records import ShardAssignment
from events.states import InstanceStatus, NodeStatus, RunnerState, StoredResponseStatus, TaskStatus

JsonList = list[Any]
JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class NodeRow:
    TABLE: ClassVar[str] = "nodes"
    node_id: str
    status: NodeStatus
    hostname: str = ""
    addresses: JsonList | None = None
    version: str = ""
    joined_at: datetime | None = None
    left_at: datetime | None = None
    last_seen: datetime | None = None
    ram_total: int = 0
    ram_available: int = 0
    swap_total: int = 0
    swap_used: int = 0
    cpu_count: int = 0
    cpu_model: str = ""
    cpu_load: float = 0.0
    disk_free: int = 0
    memory_offered: int = 0
    interfaces: JsonList | None = None
    heartbeat_s: float | None = None
    advertised: str = ""
    advertised_why: str = ""

    def key(self) -> tuple[str]:
        return (self.node_id,)


@dataclass(frozen=True, slots=True)
class DeviceRow:
    TABLE: ClassVar[str] = "devices"
    node_id: str
    device: str  # 'cpu', an accelerator ('cuda0', 'metal0'), or 'gpuN' from older workers
    kind: str  # cpu | gpu
    name: str = ""
    memory_total: int = 0
    memory_used: int = 0
    utilisation: float | None = None
    backend: str | None = None  # an accelerator's (cuda, metal...); None: the CPU, or a gpuN
    memory_free: int | None = None
    unified: bool = False  # an accelerator whose memory is the node's RAM
    compute_capability: str | None = None
    engines: JsonList | None = None  # engines that can run on it; None: any (cpu, gpuN)

    def key(self) -> tuple[str, str]:
        return (self.node_id, self.device)


@dataclass(frozen=True, slots=True)
class ModelRow:
    TABLE: ClassVar[str] = "models"
    model_id: str
    n_layers: int
    size_bytes: int
    family: str = ""
    context_length: int = 0
    engines: JsonList | None = None
    chat_format: str | None = None
    source: str = ""
    path: str | None = None
    added_at: datetime | None = None
    kv_bytes_per_token: int = 0
    overhead_bytes: int = 0
    files: JsonList | None = None  # [WeightFile] in the models bucket; None: the weights at path
    node_id: str | None = None  # the only node that serves it (--local); None: any
    vision: bool = False  # an MLX model with a vision tower (a GGUF one has a projector file)

    def key(self) -> tuple[str]:
        return (self.model_id,)


@dataclass(frozen=True, slots=True)
class InstanceRow:
    TABLE: ClassVar[str] = "instances"
    instance_id: str
    model_id: str
    status: InstanceStatus
    placement: str | None = None
    replicas: int = 1
    context_length: int | None = None
    requested_at: datetime | None = None
    placed_at: datetime | None = None
    deleted_at: datetime | None = None
    placements: int = 0  # how many times it was placed (re-placement after failures)
    reason: str | None = None
    needed_bytes: int | None = None
    generation: int = 0  # planner decisions (placed or rejected) applied so far
    avoid: JsonList | None = None  # 'node:device's where its runners kept failing
    role: InstanceRole = "chat"
    aliases: JsonList | None = None  # other names the model is called by through this instance
    requested_slots: int | None = None  # as asked for; None: chosen at placement
    slots: int | None = None  # tasks each replica serves at once, as placed; None: 1
    requested_kv_cache: KvCacheRequest = "f16"  # as asked for (auto: chosen at placement)
    kv_cache: KvCacheType = "f16"  # the KV cache's type, as placed
    speculative: JsonDict | None = None  # its runners' speculative decoding, as asked for
    on_demand: bool = False  # asked for by a request: unloaded when idle (planner/on_demand.py)
    keep_alive_s: float | None = None  # an on-demand instance's; None: the planner's default
    last_used_at: datetime | None = None  # when its model's last task in its role ended

    def key(self) -> tuple[str]:
        return (self.instance_id,)


@dataclass(frozen=True, slots=True)
class RunnerRow:
    """One shard of a placed instance, served by one runner process."""

    TABLE: ClassVar[str] = "runners"
    runner_id: str
    instance_id: str
    node_id: str
    device: str
    state: RunnerState
    replica: int = 0
    rank: int = 0
    world_size: int = 1
    start_layer: int = 0
    end_layer: int = 0
    n_layers: int = 0
    tensor_split: JsonList | None = None
    devices: JsonList | None = None  # [{device, layers}] across the node's devices; None: device
    progress: float | None = None
    error: str | None = None
    exit_code: int | None = None
    endpoint: str | None = None
    pid: int | None = None
    failures: int = 0
    last_failed_at: datetime | None = None
    failure_times: JsonList | None = None  # ISO times of the latest failures, oldest first
    updated_at: datetime | None = None
    slots: int | None = None  # tasks the runner serves at once, as it said when Ready; None: 1

    def key(self) -> tuple[str]:
        return (self.runner_id,)

    def shard(self) -> ShardAssignment:
        """The assignment this row was placed with."""
        return ShardAssignment(
            runner_id=self.runner_id,
            node_id=self.node_id,
            device=self.device,
            replica=self.replica,
            rank=self.rank,
            world_size=self.world_size,
            start_layer=self.start_layer,
            end_layer=self.end_layer,
            n_layers=self.n_layers,
            tensor_split=self.tensor_split,
            devices=self.devices or [],
        )


@dataclass(frozen=True, slots=True)
class TaskRow:
    TABLE: ClassVar[str] = "tasks"
    task_id: str
    model_id: str
    status: TaskStatus
    kind: str = "chat"
    user: str | None = None
    max_tokens: int | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    runner_id: str | None = None
    instance_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    total_ms: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    resumes: int = 0  # continuations after a lost runner
    owner: str | None = None  # the API key (key_id) that asked for it

    def key(self) -> tuple[str]:
        return (self.task_id,)


@dataclass(frozen=True, slots=True)
class ResponseRow:
    """A stored response of the Responses API (``ResponseStored``); a deleted one keeps only
    its id, task and times, so that nothing stores it again."""

    TABLE: ClassVar[str] = "responses"
    response_id: str
    status: StoredResponseStatus
    task_id: str = ""
    model_id: str = ""
    created_at: datetime | None = None
    updated_at: datetime | None = None
    deleted_at: datetime | None = None
    response: JsonDict | None = None  # the response object, as the API answers it
    input_items: JsonList | None = None
    conversation: JsonList | None = None  # ChatMessage dicts, for previous_response_id
    conversation_ref: JsonDict | None = None  # a PartRef: the conversation stored as parts
    input_items_ref: JsonDict | None = None  # a PartRef
    expires_at: datetime | None = None  # None: never
    owner: str | None = None  # the API key (key_id) that made it: only it (or an admin) sees it

    def key(self) -> tuple[str]:
        return (self.response_id,)


@dataclass(frozen=True, slots=True)
class KeyRow:
    """An API key: its name, role and digest (the key itself is nowhere), and its limits."""

    TABLE: ClassVar[str] = "api_keys"
    key_id: str
    name: str
    role: KeyRole
    digest: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    added_at: datetime | None = None
    revoked_at: datetime | None = None

    def key(self) -> tuple[str]:
        return (self.key_id,)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """What one API key's tasks of one model used, all together (ended tasks only)."""

    TABLE: ClassVar[str] = "key_usage"
    key_id: str
    model_id: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def key(self) -> tuple[str, str]:
        return (self.key_id, self.model_id)


Row = (
    NodeRow
    | DeviceRow
    | ModelRow
    | InstanceRow
    | RunnerRow
    | TaskRow
    | ResponseRow
    | KeyRow
    | UsageRow
)
ROW_TYPES: tuple[type[Row], ...] = (
    NodeRow,
    DeviceRow,
    ModelRow,
    InstanceRow,
    RunnerRow,
    TaskRow,
    ResponseRow,
    KeyRow,
    UsageRow,
)
