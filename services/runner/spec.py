"""What a worker tells a runner process it starts (one shard of one instance)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from events.catalogue import WeightFile
from events.kinds import DEFAULT_KV_CACHE, InstanceRole, KvCacheType
from events.records import ShardAssignment, Speculative


class RunnerSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    nats_url: str
    node_id: str
    instance_id: str
    model_id: str
    shard: ShardAssignment
    # What the instance serves: generation tasks, embeddings (an embedding-mode engine), or
    # reranking (the same with rank pooling).
    role: InstanceRole = "chat"
    engine: str = "llamacpp"
    # A model added with `shoal models add --local` (or before the models bucket) has its
    # file here; with neither this nor files, a built-in card is resolved by the runner.
    model_path: str | None = None
    # A shared model's files in the models bucket: the runner fetches those its shard needs
    # into its node's cache (cache_dir), unless the cache holds them already.
    files: list[WeightFile] = []
    # Where the weights came from (ModelAdded.source): a package's file on this machine with
    # the same bytes is taken rather than fetched.
    source: str = ""
    chat_format: str | None = None
    n_ctx: int = 2048
    # Tasks served at once, each with a KV cache of n_ctx (an MLX ring serves one).
    slots: int = 1
    # The type of the slots' KV cache (placement counted its memory at that type's size).
    kv_cache: KvCacheType = DEFAULT_KV_CACHE
    # Speculative decoding, as the instance asked for it (None: none).
    speculative: Speculative | None = None
    # llama.cpp threads; None = every core. Several runners on one machine must share the cores:
    # llama.cpp's threads spin-wait, and oversubscribed they fall to seconds per token.
    n_threads: int | None = None
    cache_dir: str
    # The other stages of this shard's pipeline (same instance and replica), in rank order;
    # empty for a whole model.
    peers: list[ShardAssignment] = []
    # The address this runner's data-plane listeners (llama.cpp RPC, MLX ring) bind to.
    data_host: str = "127.0.0.1"
    # Where the runner notes the task it is serving, so that its worker can fail that task if
    # the runner dies, even before its TaskStarted got out.
    task_file: str | None = None
    # How long a stage waits for the others to listen before it gives up (and is restarted).
    peer_timeout_s: float = 300.0
    # Where the runner's output goes (appended), for a runner started before its spec was
    # known (the worker's warm spare, services/worker/supervisor.py); None: where it was started.
    log_path: str | None = None

    @property
    def runner_id(self) -> str:
        return self.shard.runner_id
