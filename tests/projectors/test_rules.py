"""The transition rules, as a pure function: no NATS, no database."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from events.catalogue import (
    EVENT_TYPES,
    ChunkGenerated,
    EmbeddingsComputed,
    EmbeddingsRequested,
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
    PromptScored,
    ResourceProfiled,
    Resume,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
    TaskStarted,
    parse_event,
)
from events.records import GpuInfo, NodeProfile, ShardAssignment, Speculative, Timings, Usage
from events.units import GiB
from harness.history import history
from projectors.rows import DeviceRow, InstanceRow, ModelRow, NodeRow, Row, RunnerRow, TaskRow
from projectors.rules import changes_for, fold
from projectors.state import ClusterState, Delete, Put
from tests.events.test_catalogue import SAMPLES

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def profile(gpus: int = 0, available: int = 4 * GiB) -> NodeProfile:
    return NodeProfile(
        ram_total=8 * GiB,
        ram_available=available,
        cpu_count=4,
        cpu_model="cpu",
        cpu_load=12.5,
        memory_offered=6 * GiB,
        gpus=[
            GpuInfo(index=i, name=f"gpu{i}", memory_total=GiB, memory_used=0) for i in range(gpus)
        ],
    )


def placed(instance: str = "i1", nodes: tuple[str, ...] = ("a",), gen: int = 0) -> InstancePlaced:
    shards = [
        ShardAssignment(
            runner_id=f"{instance}-{gen}-{i}",
            node_id=n,
            rank=i,
            world_size=len(nodes),
            start_layer=i * 10,
            end_layer=(i + 1) * 10,
            n_layers=10 * len(nodes),
        )
        for i, n in enumerate(nodes)
    ]
    return InstancePlaced(
        instance_id=instance, model_id="m", origin="planner", ts=at(gen + 1), shards=shards
    )


def test_changes_for_does_not_modify_the_state() -> None:
    state = fold([NodeJoined(node_id="a", origin="a", ts=at(0))])
    before = {name: dict(rows) for name, rows in state.tables.items()}
    changes_for(state, NodeLeft(node_id="a", origin="a", ts=at(1)))
    assert state.tables == before


def test_node_lifecycle() -> None:
    state = fold([NodeJoined(node_id="a", origin="a", ts=at(0), hostname="box")])
    node = state.node("a")
    assert node is not None and node.status == "online" and node.joined_at == at(0)
    assert node.hostname == "box"

    state = fold(
        [NodeTimedOut(node_id="a", origin="p", ts=at(5), last_seen=at(1), missed_heartbeats=3)],
        state,
    )
    assert state.node("a") == replace(node, status="timed_out", left_at=at(5))

    # A heartbeat after a time-out brings the node back.
    state = fold([ResourceProfiled(node_id="a", origin="a", ts=at(6), profile=profile())], state)
    back = state.node("a")
    assert back is not None and back.status == "online" and back.last_seen == at(6)

    state = fold([NodeLeft(node_id="a", origin="a", ts=at(7))], state)
    left = state.node("a")
    assert left is not None and left.status == "left" and left.left_at == at(7)
    # ...but not after a clean leave, and a late time-out does not overwrite it.
    state = fold(
        [
            ResourceProfiled(node_id="a", origin="a", ts=at(8), profile=profile()),
            NodeTimedOut(node_id="a", origin="p", ts=at(9), last_seen=at(8), missed_heartbeats=3),
        ],
        state,
    )
    final = state.node("a")
    assert final is not None and final.status == "left"


def test_resource_profile_updates_node_and_devices() -> None:
    state = fold([NodeJoined(node_id="a", origin="a", ts=at(0))])
    state = fold(
        [ResourceProfiled(node_id="a", origin="a", ts=at(1), profile=profile(gpus=2))], state
    )
    node = state.node("a")
    assert node is not None
    assert (node.ram_total, node.ram_available, node.memory_offered) == (8 * GiB, 4 * GiB, 6 * GiB)
    devices = sorted(d.device for d in state.devices_of("a"))
    assert devices == ["cpu", "gpu0", "gpu1"]
    cpu = state.tables["devices"][("a", "cpu")]
    assert isinstance(cpu, DeviceRow)
    assert cpu.memory_used == 4 * GiB and cpu.utilisation == 12.5

    # A GPU that disappears is deleted; the change list says so.
    e = ResourceProfiled(node_id="a", origin="a", ts=at(2), profile=profile(gpus=1))
    changes = changes_for(state, e)
    assert Delete("devices", ("a", "gpu1")) in changes
    state.commit(changes)
    assert sorted(d.device for d in state.devices_of("a")) == ["cpu", "gpu0"]


def test_heartbeat_from_unknown_node_creates_it() -> None:
    state = fold([ResourceProfiled(node_id="z", origin="z", ts=at(1), profile=profile())])
    node = state.node("z")
    assert node is not None and node.status == "online" and node.joined_at == at(1)


def test_model_added_replaces_the_card() -> None:
    a = ModelAdded(model_id="m", origin="c", ts=at(0), n_layers=10, size_bytes=1)
    b = ModelAdded(model_id="m", origin="c", ts=at(1), n_layers=12, size_bytes=2)
    model = fold([a, b]).model("m")
    assert model is not None and (model.n_layers, model.size_bytes) == (12, 2)


def test_instance_requested_then_placed_creates_runners() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0), replicas=1),
            placed(nodes=("a", "b")),
        ]
    )
    inst = state.instance("i1")
    assert inst is not None and inst.status == "placed" and inst.placements == 1
    runners = sorted(state.runners_of("i1"), key=lambda r: r.rank)
    assert [(r.node_id, r.start_layer, r.end_layer, r.state) for r in runners] == [
        ("a", 0, 10, "Assigned"),
        ("b", 10, 20, "Assigned"),
    ]


def test_an_instance_keeps_the_speculative_decoding_it_asked_for() -> None:
    drafts = Speculative(type="ngram", draft_max=8)
    asked = InstanceRequested(instance_id="i1", model_id="m", origin="api", speculative=drafts)
    inst = fold([asked, placed(nodes=("a",))]).instance("i1")
    assert inst is not None and inst.speculative == drafts.model_dump()
    # An older log's request has none.
    old = fold([InstanceRequested(instance_id="i2", model_id="m", origin="api")]).instance("i2")
    assert old is not None and old.speculative is None


def test_second_request_with_same_id_is_ignored() -> None:
    first = InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0))
    again = InstanceRequested(instance_id="i1", model_id="other", origin="api", ts=at(1))
    state = fold([first])
    assert changes_for(state, again) == []


def test_replacement_supersedes_old_runners() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0)),
            placed(nodes=("a", "b"), gen=0),
            placed(nodes=("c",), gen=1),
        ]
    )
    inst = state.instance("i1")
    assert inst is not None and inst.placements == 2
    assert [r.runner_id for r in state.runners_of("i1")] == ["i1-1-0"]
    # A late report from a superseded runner changes nothing.
    late = RunnerStateChanged(
        runner_id="i1-0-1", instance_id="i1", node_id="b", state="Failed", origin="b", ts=at(9)
    )
    assert changes_for(state, late) == []


def test_a_decision_counts_only_for_the_next_generation() -> None:
    state = fold([InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0))])
    first = placed(nodes=("a",)).model_copy(update={"generation": 1})
    state = fold([first], state)
    # The same decision again, or a second planner's different decision for generation 1,
    # is stale once generation 1 is applied.
    other = placed(nodes=("b",)).model_copy(update={"generation": 1})
    assert changes_for(state, first) == [] and changes_for(state, other) == []
    rejected = PlacementRejected(
        instance_id="i1", model_id="m", origin="p", ts=at(5), reason="full", generation=3
    )
    assert changes_for(state, rejected) == []  # skips generation 2: not next either
    state = fold([rejected.model_copy(update={"generation": 2})], state)
    inst = state.instance("i1")
    assert inst is not None
    assert (inst.status, inst.generation, inst.reason) == ("rejected", 2, "full")


def test_a_new_placement_keeps_the_runners_of_unchanged_shards() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0)),
            placed(nodes=("a", "b")),
            RunnerStateChanged(
                runner_id="i1-0-0",
                instance_id="i1",
                node_id="a",
                state="Ready",
                origin="a",
                ts=at(2),
            ),
        ]
    )
    moved = placed(nodes=("a", "b")).shards
    again = InstancePlaced(
        instance_id="i1",
        model_id="m",
        origin="p",
        ts=at(3),
        reason="node b timed out",
        shards=[moved[0], moved[1].model_copy(update={"runner_id": "i1-1-1", "node_id": "c"})],
    )
    state = fold([again], state)
    runners = {r.runner_id: (r.node_id, r.state) for r in state.runners_of("i1")}
    assert runners == {"i1-0-0": ("a", "Ready"), "i1-1-1": ("c", "Assigned")}
    inst = state.instance("i1")
    assert inst is not None and (inst.placements, inst.reason) == (2, "node b timed out")


def test_runner_states_and_failures() -> None:
    state = fold(
        [InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0)), placed()]
    )

    def report(state_name: str, t: float, **kw: object) -> RunnerStateChanged:
        return RunnerStateChanged.model_validate(
            dict(
                runner_id="i1-0-0",
                instance_id="i1",
                node_id="a",
                state=state_name,
                origin="a",
                ts=at(t),
                **kw,
            )
        )

    state = fold(
        [
            report("Loading", 2, progress=0.5, pid=42),
            report("Ready", 3, endpoint="127.0.0.1:5000"),
            report("Failed", 4, error="segfault", exit_code=-11),
            report("Loading", 5),
            report("Failed", 6, error="oom", exit_code=137),
        ],
        state,
    )
    r = state.runner("i1-0-0")
    assert r is not None
    assert r == RunnerRow(
        runner_id="i1-0-0",
        instance_id="i1",
        node_id="a",
        device="cpu",
        state="Failed",
        replica=0,
        rank=0,
        world_size=1,
        start_layer=0,
        end_layer=10,
        n_layers=10,
        tensor_split=None,
        progress=None,
        error="oom",
        exit_code=137,
        endpoint="127.0.0.1:5000",
        pid=42,
        failures=2,
        last_failed_at=at(6),
        updated_at=at(6),
        failure_times=[at(4).isoformat(), at(6).isoformat()],
    )


def test_slots_asked_for_placed_and_reported() -> None:
    asked = InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0), slots=4)
    state = fold([asked, placed().model_copy(update={"slots": 4})])
    inst = state.instance("i1")
    assert inst is not None and (inst.requested_slots, inst.slots) == (4, 4)

    def report(state_name: str, t: float, slots: int | None = None) -> RunnerStateChanged:
        return RunnerStateChanged(
            runner_id="i1-0-0",
            instance_id="i1",
            node_id="a",
            state=state_name,
            origin="a",
            ts=at(t),
            slots=slots,
        )

    runner = state.runner("i1-0-0")
    assert runner is not None and runner.slots is None  # not said until Ready
    state = fold([report("Loading", 2), report("Ready", 3, slots=4), report("Running", 4)], state)
    runner = state.runner("i1-0-0")
    assert runner is not None and runner.slots == 4  # kept through later reports
    # A process started anew has not said its slots yet.
    state = fold([report("Failed", 5), report("Assigned", 6)], state)
    runner = state.runner("i1-0-0")
    assert runner is not None and runner.slots is None

    rejected = PlacementRejected(
        instance_id="i1", model_id="m", origin="p", ts=at(7), reason="no room"
    )
    inst = fold([rejected], state).instance("i1")
    assert inst is not None and (inst.requested_slots, inst.slots) == (4, None)


def test_events_without_slots_project_none() -> None:
    """An older log (no slots anywhere) folds to NULL slots: one task at a time."""
    state = fold(
        [
            InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0)),
            placed(),
            RunnerStateChanged(
                runner_id="i1-0-0",
                instance_id="i1",
                node_id="a",
                state="Ready",
                origin="a",
                ts=at(2),
            ),
        ]
    )
    inst, runner = state.instance("i1"), state.runner("i1-0-0")
    assert inst is not None and (inst.requested_slots, inst.slots) == (None, None)
    assert runner is not None and runner.slots is None


def test_rejection_and_deletion() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i1", model_id="m", origin="api", ts=at(0)),
            placed(),
            PlacementRejected(
                instance_id="i1",
                model_id="m",
                origin="p",
                ts=at(3),
                reason="no room",
                needed_bytes=GiB,
            ),
        ]
    )
    inst = state.instance("i1")
    assert inst is not None and (inst.status, inst.reason, inst.needed_bytes) == (
        "rejected",
        "no room",
        GiB,
    )
    assert list(state.runners_of("i1")) == []

    state = fold(
        [
            InstanceDeleteRequested(instance_id="i1", origin="api", ts=at(4), reason="bye"),
            InstanceDeleted(instance_id="i1", origin="a", ts=at(5)),
        ],
        state,
    )
    inst = state.instance("i1")
    assert inst is not None and inst.status == "deleted" and inst.deleted_at == at(5)
    assert inst.reason == "bye"
    # A placement decided before the delete but logged after it does not revive the instance.
    assert changes_for(state, placed(gen=7)) == []


def test_task_lifecycle_completed() -> None:
    state = fold(
        [
            TaskCreated(task_id="t", model_id="m", origin="api", ts=at(0), user="u"),
            TaskStarted(
                task_id="t", model_id="m", origin="a", ts=at(1), runner_id="r", instance_id="i"
            ),
            ChunkGenerated(task_id="t", idx=0, text="hi", origin="a", ts=at(1.5)),
            TaskCompleted(
                task_id="t",
                model_id="m",
                origin="a",
                ts=at(2),
                runner_id="r",
                finish_reason="length",
                usage=Usage(prompt_tokens=7, completion_tokens=3),
                timings=Timings(ttft_ms=12.0, tokens_per_s=30.0, total_ms=100.0),
            ),
        ]
    )
    t = state.task("t")
    assert t is not None
    assert (t.status, t.runner_id, t.instance_id, t.user) == ("completed", "r", "i", "u")
    assert (t.prompt_tokens, t.completion_tokens, t.finish_reason) == (7, 3, "length")
    assert (t.created_at, t.started_at, t.finished_at) == (at(0), at(1), at(2))
    assert (t.ttft_ms, t.tokens_per_s, t.total_ms) == (12.0, 30.0, 100.0)


def test_cancel_is_final() -> None:
    created = TaskCreated(task_id="t", model_id="m", origin="api", ts=at(0))
    cancelled = TaskCancelled(task_id="t", model_id="m", origin="api", ts=at(1), reason="gone")
    started = TaskStarted(
        task_id="t", model_id="m", origin="a", ts=at(2), runner_id="r", instance_id="i"
    )
    failed = TaskFailed(task_id="t", model_id="m", origin="a", ts=at(3), error="x")
    state = fold([created, cancelled, started, failed])
    t = state.task("t")
    assert t is not None and t.status == "cancelled" and t.error == "gone"
    assert t.runner_id == "r"  # but who had it is still recorded


def test_only_an_ended_task_is_forgotten() -> None:
    def forgotten(task_id: str) -> TaskForgotten:
        return TaskForgotten(task_id=task_id, model_id="m", origin="planner", ts=at(9))

    ended: list[Event] = [
        TaskCreated(task_id="done", model_id="m", origin="api", ts=at(0), owner="k"),
        TaskCompleted(
            task_id="done",
            model_id="m",
            origin="a",
            ts=at(1),
            runner_id="r",
            finish_reason="stop",
            usage=Usage(prompt_tokens=7, completion_tokens=3),
            timings=Timings(ttft_ms=12.0, tokens_per_s=30.0, total_ms=100.0),
        ),
    ]
    waiting = TaskCreated(task_id="open", model_id="m", origin="api", ts=at(2))
    before = fold([*ended, waiting])
    after = fold([forgotten("done"), forgotten("open"), forgotten("never")], before.copy())
    assert list(after.task_rows) == [("open",)]
    assert after.usage_rows == before.usage_rows and after.usage_rows  # usage stays counted


def test_a_resumed_task_waits_again_and_counts_its_resumes() -> None:
    created = TaskCreated(task_id="t", model_id="m", origin="api", ts=at(0), user="u")
    started = TaskStarted(
        task_id="t", model_id="m", origin="a", ts=at(1), runner_id="r", instance_id="i"
    )

    def resumed(attempt: int, ts: float) -> TaskCreated:
        resume = Resume(attempt=attempt, tokens=[1, 2], runner_id="r")
        return created.model_copy(update={"resume": resume, "ts": at(ts), "origin": "node"})

    state = fold([created, started, resumed(1, 2)])
    t = state.task("t")
    assert t is not None and (t.status, t.resumes, t.user) == ("pending", 1, "u")
    assert (t.created_at, t.runner_id) == (at(0), "r")  # as first asked, where it ran
    # Started again, and the same continuation seen twice counts once.
    state = fold([created, started, resumed(1, 2), started, resumed(1, 3)])
    t = state.task("t")
    assert t is not None and (t.status, t.resumes) == ("running", 1)
    # An ended task is not taken up again; one never resumed says 0.
    failed = TaskFailed(task_id="t", model_id="m", origin="a", ts=at(2), error="x")
    t = fold([created, started, failed, resumed(1, 3)]).task("t")
    assert t is not None and (t.status, t.resumes) == ("failed", 0)


def test_failed_task() -> None:
    state = fold(
        [
            TaskCreated(task_id="t", model_id="m", origin="api", ts=at(0)),
            TaskFailed(task_id="t", model_id="m", origin="a", ts=at(1), error="too long"),
        ]
    )
    t = state.task("t")
    assert t is not None and (t.status, t.error, t.finished_at) == ("failed", "too long", at(1))


def test_an_embeddings_task_is_a_task_row() -> None:
    requested = EmbeddingsRequested(
        task_id="e", model_id="m", origin="api", ts=at(0), texts=["a", "b"], user="u"
    )
    state = fold(
        [
            requested,
            TaskStarted(
                task_id="e", model_id="m", origin="a", ts=at(1), runner_id="r", instance_id="i"
            ),
            EmbeddingsComputed(
                task_id="e",
                origin="a",
                ts=at(1.5),
                start=0,
                total=2,
                dimensions=1,
                vectors="AACAPwAAgD8=",
            ),
            TaskCompleted(
                task_id="e",
                model_id="m",
                origin="a",
                ts=at(2),
                runner_id="r",
                finish_reason="stop",
                usage=Usage(prompt_tokens=9, completion_tokens=0),
                timings=Timings(ttft_ms=50.0, tokens_per_s=0.0, total_ms=50.0),
            ),
        ]
    )
    t = state.task("e")
    assert t is not None
    assert (t.kind, t.status, t.user, t.runner_id, t.instance_id) == (
        "embedding",
        "completed",
        "u",
        "r",
        "i",
    )
    assert (t.prompt_tokens, t.completion_tokens, t.max_tokens) == (9, 0, None)
    assert (t.created_at, t.started_at, t.finished_at) == (at(0), at(1), at(2))
    # A request again (a redelivery, a second API) changes nothing; the vectors never do.
    assert changes_for(state, requested) == []
    assert (
        changes_for(
            ClusterState(),
            EmbeddingsComputed(
                task_id="x", origin="a", start=0, total=1, dimensions=1, vectors="AACAPw=="
            ),
        )
        == []
    )


def test_a_failed_embeddings_task() -> None:
    state = fold(
        [
            EmbeddingsRequested(
                task_id="e", model_id="m", origin="api", ts=at(0), token_ids=[[1, 2]]
            ),
            TaskFailed(
                task_id="e",
                model_id="m",
                origin="a",
                ts=at(1),
                error="invalid request: input 0 has 900 tokens",
            ),
        ]
    )
    t = state.task("e")
    assert t is not None and (t.kind, t.status) == ("embedding", "failed")
    assert t.error == "invalid request: input 0 has 900 tokens"


def test_events_for_unknown_rows_change_nothing() -> None:
    empty = ClusterState()
    for e in (
        NodeLeft(node_id="x", origin="x"),
        TaskStarted(task_id="t", model_id="m", origin="a", runner_id="r", instance_id="i"),
        TaskCancelled(task_id="t", model_id="m", origin="a"),
        InstanceDeleted(instance_id="i", origin="a"),
        RunnerStateChanged(runner_id="r", instance_id="i", node_id="n", state="Ready", origin="n"),
    ):
        assert changes_for(empty, e) == [], e.type


def test_fold_of_a_history_is_deterministic() -> None:
    events = list(history(n_tasks=120, seed=3))
    a, b = fold(events), fold(events)
    assert a.tables == b.tables
    statuses = {t.status for t in a.rows("tasks")}  # type: ignore[union-attr]
    assert {"completed", "failed", "cancelled"} <= statuses
    inst2 = a.instance("inst-2")
    assert inst2 is not None and inst2.placements == 2
    assert {r.node_id for r in a.runners_of("inst-2")} == {"node-a", "node-b"}
    node_c = a.node("node-c")
    assert node_c is not None and node_c.status == "timed_out"


def test_puts_carry_their_key() -> None:
    row = NodeRow(node_id="a", status="online")
    assert Put(row).table == "nodes" and Put(row).key == ("a",)


# What the chunk stream carries: no rows (the projection keeps task outcomes).
PROJECTION_FREE = {ChunkGenerated, PromptScored, EmbeddingsComputed}


def test_every_event_type_has_a_rule_or_changes_nothing() -> None:
    """``changes_for`` is a match that mypy checks is exhaustive; here each type's sample runs
    through it (an event type without a case would reach assert_never and raise)."""
    assert set(SAMPLES) == set(EVENT_TYPES)
    for cls, sample in SAMPLES.items():
        changes = changes_for(ClusterState(), parse_event(sample.to_json()))
        if cls in PROJECTION_FREE:
            assert changes == [], cls.__name__


def test_the_state_keeps_each_table_s_own_row_type() -> None:
    state = fold(list(history(n_tasks=20, seed=5)))
    typed: list[tuple[type[Row], Sequence[Row]]] = [
        (NodeRow, state.nodes()),
        (DeviceRow, state.devices()),
        (ModelRow, state.models()),
        (InstanceRow, state.instances()),
        (RunnerRow, state.runners()),
        (TaskRow, state.tasks()),
    ]
    for row_type, rows in typed:
        assert rows and all(type(r) is row_type for r in rows), row_type
        assert rows == state.rows(row_type.TABLE)
    copy = state.copy()
    copy.commit([Delete(NodeRow.TABLE, state.nodes()[0].key())])
    assert len(copy.nodes()) == len(state.nodes()) - 1
    assert copy.tables != state.tables and copy.task_rows == state.task_rows
