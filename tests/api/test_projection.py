"""When the API accepts a request for a model: decided from the projection alone."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from api.errors import ApiError
from api.projection import coming_back, require_serving, serving
from events.kinds import InstanceRole
from events.states import InstanceStatus, RunnerState
from projectors import database
from projectors.rows import InstanceRow, ModelRow, RunnerRow
from projectors.state import ClusterState, Delete, Put
from projectors.store import write_changes


def cluster(status: InstanceStatus, *runners: tuple[int, RunnerState]) -> ClusterState:
    """One model, one instance of it with ``status``, runners as (rank, state)."""
    state = ClusterState()
    state.commit(
        [
            Put(ModelRow(model_id="m", n_layers=30, size_bytes=1)),
            Put(
                InstanceRow(instance_id="i", model_id="m", status=status, reason="it needs 199 MiB")
            ),
        ]
    )
    for rank, runner_state in runners:
        state.commit(
            [
                Put(
                    RunnerRow(
                        runner_id=f"r{rank}",
                        instance_id="i",
                        node_id=f"n{rank}",
                        device="cpu",
                        state=runner_state,
                        rank=rank,
                        world_size=len(runners),
                    )
                )
            ]
        )
    return state


def test_a_ready_whole_model_or_pipeline_head_serves() -> None:
    require_serving(cluster("placed", (0, "Ready")), "m")
    require_serving(cluster("placed", (0, "Running"), (1, "Ready")), "m")


def test_a_pipeline_whose_head_is_not_ready_does_not_serve() -> None:
    """Later stages report Ready as soon as they listen; no task is pulled until the head is."""
    with pytest.raises(ApiError) as err:
        require_serving(cluster("placed", (0, "Loading"), (1, "Ready")), "m")
    assert err.value.status == 503 and "runners: Loading, Ready" in err.value.message


def test_a_rejected_instance_does_not_serve_and_says_why() -> None:
    """Its runners are being stopped, even if the last word of one was Ready."""
    with pytest.raises(ApiError) as err:
        require_serving(cluster("rejected", (0, "Ready")), "m")
    assert err.value.status == 503 and "could not be placed: it needs 199 MiB" in err.value.message


def test_a_model_is_coming_back_while_a_placed_instance_s_head_starts_again() -> None:
    """A waiting task waits for it (``resume_within_s``); for nothing else."""
    for head in ("Assigned", "Downloading", "Loading", "Failed"):
        assert coming_back(cluster("placed", (0, head), (1, "Ready")), "m"), head
    assert not coming_back(cluster("placed", (0, "Stopped")), "m")
    assert not coming_back(cluster("rejected", (0, "Loading")), "m")
    assert not coming_back(cluster("requested"), "m")  # waiting for room may be for ever
    assert not coming_back(cluster("placed", (0, "Loading")), "other")


def test_an_unknown_model_is_404() -> None:
    with pytest.raises(ApiError) as err:
        require_serving(cluster("placed", (0, "Ready")), "other")
    assert err.value.status == 404 and "known models: m" in err.value.message


def test_a_removed_model_with_deleted_instances_is_404_and_a_known_one_503() -> None:
    removed = cluster("deleted")
    removed.commit([Delete(ModelRow.TABLE, ("m",))])
    with pytest.raises(ApiError) as err:
        require_serving(removed, "m")
    assert err.value.status == 404 and "does not exist" in err.value.message
    with pytest.raises(ApiError) as err:
        require_serving(cluster("deleted"), "m")
    assert err.value.status == 503


async def test_serving_reads_the_model_s_instances_and_runners_from_the_database(
    engine: AsyncEngine, db_url: str
) -> None:
    """Through the async engine, and (SQLite) through the plain reader every API request uses;
    the models only when the model has no instance."""
    await database.upgrade(engine)
    async with engine.begin() as conn:
        rows = cluster("placed", (0, "Ready")).tables.values()
        await write_changes(conn, [Put(row) for table in rows for row in table.values()])
    reader = database.sqlite_reader(db_url)
    assert (reader is None) == db_url.startswith("postgresql")
    try:
        for via in {None, reader}:
            state = await serving(engine, "m", via)
            assert [i.instance_id for i in state.instances()] == ["i"]
            assert [r.state for r in state.runners_of("i")] == ["Ready"]
            assert state.models() == []  # not read: the model has an instance
            require_serving(state, "m")
            other = await serving(engine, "other", via)
            assert [m.model_id for m in other.models()] == ["m"]
    finally:
        if reader is not None:
            reader.dispose()


def with_instance(
    state: ClusterState, instance_id: str, role: InstanceRole, runner_state: RunnerState
) -> None:
    state.commit(
        [
            Put(InstanceRow(instance_id=instance_id, model_id="m", status="placed", role=role)),
            Put(
                RunnerRow(
                    runner_id=f"{instance_id}-r",
                    instance_id=instance_id,
                    node_id="n",
                    device="cpu",
                    state=runner_state,
                )
            ),
        ]
    )


def test_embeddings_need_an_embed_instance_and_say_how_to_ask_for_one() -> None:
    chat_only = cluster("placed", (0, "Ready"))
    require_serving(chat_only, "m")
    require_serving(chat_only, "m", "chat")
    with pytest.raises(ApiError) as err:
        require_serving(chat_only, "m", "embed")
    assert (err.value.status, err.value.param) == (400, "model")
    assert "served for chat only" in err.value.message
    assert 'POST /v1/instances {"model": "m", "role": "embed"}' in err.value.message
    assert "shoal instances create m --role embed" in err.value.message


def test_chat_needs_a_chat_instance() -> None:
    state = ClusterState()
    state.commit([Put(ModelRow(model_id="m", n_layers=30, size_bytes=1))])
    with_instance(state, "e", "embed", "Ready")
    require_serving(state, "m", "embed")
    with pytest.raises(ApiError) as err:
        require_serving(state, "m")
    assert err.value.status == 400 and "served for embeddings only" in err.value.message


def test_chat_and_embed_instances_of_one_model_serve_each_their_own() -> None:
    state = cluster("placed", (0, "Ready"))
    with_instance(state, "e", "embed", "Loading")
    require_serving(state, "m", "chat")
    with pytest.raises(ApiError) as err:  # the embed one exists, but is not ready yet: 503
        require_serving(state, "m", "embed")
    assert err.value.status == 503 and "instance e is starting" in err.value.message
    with_instance(state, "e", "embed", "Ready")
    require_serving(state, "m", "embed")
