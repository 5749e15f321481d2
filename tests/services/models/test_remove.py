"""Removing a model: refused while an instance uses it; its bucket objects deleted unless
another model names them; the projection (SQLite and PostgreSQL) forgets it; it can be added
again. Against a real nats-server and a real projector."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.publisher import Publisher
from bus.reader import read_stream
from bus.stores.object_store import object_info
from bus.streams import EVENTS_STREAM, MODELS_BUCKET
from events.catalogue import (
    InstanceDeleteRequested,
    InstanceRequested,
    ModelAdded,
    ModelRemoved,
    WeightFile,
    parse_event,
)
from projectors.rules import fold
from projectors.state import ClusterState
from projectors.store import load_state
from services.models.remove import (
    ModelInUse,
    ModelNotKnown,
    live_instances,
    remove_model,
    unnamed_objects,
)
from services.models.shared import store_files
from tests.projectors.helpers import running_projector, wait_for_seq


def weight(name: str, sha: str) -> WeightFile:
    return WeightFile(name=name, object=f"sha256/{sha}", size=1, sha256=sha)


def added(model_id: str, files: list[WeightFile]) -> ModelAdded:
    return ModelAdded(model_id=model_id, origin="t", n_layers=1, size_bytes=1, files=files)


def test_which_instances_use_a_model_and_which_objects_go() -> None:
    state = fold(
        [
            InstanceRequested(instance_id="i2", model_id="m", origin="t"),
            InstanceRequested(instance_id="i1", model_id="m", origin="t"),
            InstanceRequested(instance_id="gone", model_id="m", origin="t"),
            InstanceDeleteRequested(instance_id="gone", origin="t"),
            InstanceRequested(instance_id="other", model_id="n", origin="t"),
        ]
    )
    assert live_instances(state, "m") == ["i1", "i2"]
    a, b, c = weight("a", "a" * 64), weight("b", "b" * 64), weight("c", "c" * 64)
    other = fold([added("n", [b, c])])
    gone, kept = unnamed_objects([a, b, a], other.models())
    assert (gone, kept) == ([a], [b])


def _write(directory: Path, *sizes: int) -> list[tuple[str, Path]]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, size in enumerate(sizes):
        path = directory / f"f{i}.gguf"
        path.write_bytes(os.urandom(size))
        paths.append((path.name, path))
    return paths


async def _files(js: JetStreamContext, directory: Path, *sizes: int) -> list[WeightFile]:
    return await store_files(js, _write(directory, *sizes))


async def _stored(js: JetStreamContext, f: WeightFile) -> bool:
    return await object_info(js, MODELS_BUCKET, f.object) is not None


async def test_remove_is_refused_while_used_then_deletes_what_no_model_names(
    js: JetStreamContext, engine: AsyncEngine, tmp_path: Path
) -> None:
    own, shared, others = await _files(js, tmp_path, 300_000, 200_000, 100_000)
    messages = (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages
    pub = Publisher(js)
    await pub.publish(added("m", [own, shared]))
    await pub.publish(added("n", [shared, others]))
    ack = await pub.publish(InstanceRequested(instance_id="i1", model_id="m", origin="t"))

    async def projection() -> ClusterState:
        async with engine.connect() as conn:
            return await load_state(conn)

    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, ack.seq)
        with pytest.raises(ModelInUse) as refused:
            await remove_model(js, await projection(), "m")
        assert refused.value.instances == ["i1"]
        with pytest.raises(ModelNotKnown):
            await remove_model(js, await projection(), "no-such-model")
        ack = await pub.publish(InstanceDeleteRequested(instance_id="i1", origin="t"))
        await wait_for_seq(projector, ack.seq)

        removal = await remove_model(js, await projection(), "m", reason="test")
        assert removal.deleted == (own,) and removal.kept == (shared,)
        await wait_for_seq(projector, removal.seq)
        state = await projection()
        assert state.model("m") is None and state.model("n") is not None
        assert not await _stored(js, own)
        assert await _stored(js, shared) and await _stored(js, others)
        # The deleted object's two chunks are gone from the stream; its meta is a marker.
        assert (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages == messages - 2

        # Added again later: known again (its file stored again).
        (again,) = await _files(js, tmp_path / "again", 300_000)
        ack = await pub.publish(added("m", [again]))
        await wait_for_seq(projector, ack.seq)
        assert (await projection()).model("m") is not None

    events = [
        parse_event(m.data) async for m in read_stream(js, EVENTS_STREAM, "shoal.events.model.>")
    ]
    assert [type(e).__name__ for e in events] == [
        "ModelAdded",
        "ModelAdded",
        "ModelRemoved",
        "ModelAdded",
    ]
    assert isinstance(events[2], ModelRemoved) and events[2].reason == "test"


async def test_a_model_added_since_the_projection_counts(
    js: JetStreamContext, tmp_path: Path
) -> None:
    """The projection may lag: the log's model events say what is known."""
    (f,) = await _files(js, tmp_path, 50_000)
    pub = Publisher(js)
    await pub.publish(added("m", [f]))
    await pub.publish(added("n", [f]))  # not projected yet, and names the same object
    removal = await remove_model(js, ClusterState(), "m")
    assert removal.deleted == () and removal.kept == (f,) and await _stored(js, f)
    removal = await remove_model(js, ClusterState(), "n")
    assert removal.deleted == (f,) and not await _stored(js, f)
    with pytest.raises(ModelNotKnown):
        await remove_model(js, ClusterState(), "n")
