"""Realistic, deterministic event histories for tests and benchmarks.

A small cluster's life: nodes join and send heartbeats, models are added, instances are
requested, placed, re-placed after a node times out, and deleted; runners change state; tasks
are created, started, streamed as chunks and completed, failed or cancelled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from events.catalogue import (
    ChunkGenerated,
    Event,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    ModelAdded,
    NodeJoined,
    NodeLeft,
    NodeTimedOut,
    PlacementRejected,
    ResourceProfiled,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
    TaskStarted,
)
from events.records import (
    ChatMessage,
    GpuInfo,
    NetworkInterface,
    NodeProfile,
    SamplingParams,
    ShardAssignment,
    Timings,
    Usage,
)
from events.units import GiB

START = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
MODELS = ("smollm2-135m", "gemma3-270m", "Qwen2.5-0.5B")


class _Clock:
    def __init__(self) -> None:
        self.now = START

    def tick(self, ms: int = 10) -> datetime:
        self.now += timedelta(milliseconds=ms)
        return self.now


def profile(rng: random.Random, gpus: int = 0) -> NodeProfile:
    total = 16 * GiB
    return NodeProfile(
        ram_total=total,
        ram_available=rng.randint(4, 12) * GiB,
        swap_total=2 * GiB,
        swap_used=rng.randint(0, 100) * 1024**2,
        cpu_count=8,
        cpu_model="Test CPU",
        cpu_load=round(rng.uniform(0, 100), 1),
        disk_free=100 * GiB,
        memory_offered=8 * GiB,
        interfaces=[NetworkInterface(name="lo", addresses=["127.0.0.1"])],
        gpus=[
            GpuInfo(index=i, name="Test GPU", memory_total=8 * GiB, memory_used=GiB, utilisation=5)
            for i in range(gpus)
        ],
    )


def history(n_tasks: int = 300, seed: int = 1, chunks_per_task: int = 4) -> Iterator[Event]:
    """Yield events in the order a live cluster could have published them."""
    rng = random.Random(seed)
    clock = _Clock()
    nodes = ["node-a", "node-b", "node-c"]

    def heartbeat(node: str) -> ResourceProfiled:
        gpus = 1 if node == "node-c" else 0
        return ResourceProfiled(
            node_id=node, origin=node, ts=clock.tick(), profile=profile(rng, gpus)
        )

    for node in nodes:
        yield NodeJoined(
            node_id=node, origin=node, ts=clock.tick(), hostname=node, addresses=["127.0.0.1"]
        )
        yield heartbeat(node)
    for model in MODELS:
        yield ModelAdded(
            model_id=model,
            origin="cli",
            ts=clock.tick(),
            n_layers=30,
            size_bytes=GiB,
            context_length=2048,
            chat_format="chatml",
        )

    def place(instance: str, model: str, on: list[str], gen: int) -> Iterator[Event]:
        per = 30 // len(on)
        shards = [
            ShardAssignment(
                runner_id=f"{instance}-r{gen}-{i}",
                node_id=node,
                rank=i,
                world_size=len(on),
                start_layer=i * per,
                end_layer=30 if i == len(on) - 1 else (i + 1) * per,
                n_layers=30,
            )
            for i, node in enumerate(on)
        ]
        yield InstancePlaced(
            instance_id=instance, model_id=model, origin="planner", ts=clock.tick(), shards=shards
        )
        for s in shards:
            for state in ("Assigned", "Loading", "Ready"):
                yield RunnerStateChanged(
                    runner_id=s.runner_id,
                    instance_id=instance,
                    node_id=s.node_id,
                    state=state,
                    origin=s.node_id,
                    ts=clock.tick(),
                    pid=1000 + s.rank,
                    progress=1.0 if state == "Loading" else None,
                )

    instances = {"inst-1": MODELS[0], "inst-2": MODELS[1], "inst-3": MODELS[2]}
    for inst, model in instances.items():
        yield InstanceRequested(instance_id=inst, model_id=model, origin="api", ts=clock.tick())
    yield from place("inst-1", MODELS[0], ["node-a"], 0)
    yield from place("inst-2", MODELS[1], ["node-b", "node-c"], 0)
    yield PlacementRejected(
        instance_id="inst-3",
        model_id=MODELS[2],
        origin="planner",
        ts=clock.tick(),
        reason="needs 40.0 GiB; node-a offers 8.0 GiB",
        needed_bytes=40 * GiB,
        available_bytes={n: 8 * GiB for n in nodes},
    )

    runner_of = {MODELS[0]: ("inst-1", "inst-1-r0-0"), MODELS[1]: ("inst-2", "inst-2-r0-0")}
    for t in range(n_tasks):
        if t % 25 == 0:
            for node in nodes:
                if not (node == "node-c" and t > n_tasks // 2):  # node-c went silent
                    yield heartbeat(node)
        if t == n_tasks // 2:
            # node-c stops answering: inst-2 moves to node-a and node-b.
            yield NodeTimedOut(
                node_id="node-c",
                origin="planner",
                ts=clock.tick(),
                last_seen=clock.now,
                missed_heartbeats=3,
            )
            yield RunnerStateChanged(
                runner_id="inst-2-r0-1",
                instance_id="inst-2",
                node_id="node-c",
                state="Failed",
                origin="node-b",
                ts=clock.tick(),
                error="peer lost",
                exit_code=-9,
            )
            yield from place("inst-2", MODELS[1], ["node-a", "node-b"], 1)
            runner_of[MODELS[1]] = ("inst-2", "inst-2-r1-0")
        if t >= 30 and t % 10 == 0:  # a planner forgets a task that ended long ago
            old = t - 30
            yield TaskForgotten(
                task_id=f"task-{old:05d}",
                model_id=MODELS[old % 2],
                origin="planner",
                ts=clock.tick(),
            )
        model = MODELS[t % 2]
        instance, runner = runner_of[model]
        task = f"task-{t:05d}"
        yield TaskCreated(
            task_id=task,
            model_id=model,
            origin="api",
            ts=clock.tick(),
            messages=[ChatMessage(role="user", content=f"question {t}")],
            params=SamplingParams(max_tokens=16, temperature=0.0),
            user=f"user-{t % 7}",
        )
        outcome = rng.random()
        if outcome < 0.05:
            yield TaskFailed(
                task_id=task,
                model_id=model,
                origin="node-a",
                ts=clock.tick(),
                error="prompt longer than the context (4096 > 2048 tokens)",
            )
            continue
        yield TaskStarted(
            task_id=task,
            model_id=model,
            origin="node-a",
            ts=clock.tick(),
            runner_id=runner,
            instance_id=instance,
        )
        n = rng.randint(1, chunks_per_task)
        for i in range(n):
            yield ChunkGenerated(
                task_id=task,
                idx=i,
                text=f" tok{i}",
                token_id=100 + i,
                origin="node-a",
                ts=clock.tick(1),
                finish_reason="stop" if i == n - 1 else None,
            )
        if outcome < 0.10:
            yield TaskCancelled(
                task_id=task,
                model_id=model,
                origin="api",
                ts=clock.tick(),
                reason="client disconnected",
            )
        yield TaskCompleted(
            task_id=task,
            model_id=model,
            origin="node-a",
            ts=clock.tick(),
            runner_id=runner,
            finish_reason="cancelled" if outcome < 0.10 else "stop",
            usage=Usage(prompt_tokens=12, completion_tokens=n),
            timings=Timings(
                ttft_ms=rng.uniform(5, 50),
                tokens_per_s=rng.uniform(20, 80),
                total_ms=rng.uniform(50, 500),
            ),
        )
    yield InstanceDeleteRequested(instance_id="inst-1", origin="api", ts=clock.tick())
    yield InstanceDeleted(instance_id="inst-1", origin="node-a", ts=clock.tick(), reason="asked")
    yield NodeLeft(node_id="node-b", origin="node-b", ts=clock.tick())
