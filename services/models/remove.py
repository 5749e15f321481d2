"""Removing a model the cluster knows, as ``shoal models remove`` and Ollama's DELETE do it:
refused while a live instance uses it; else ``ModelRemoved`` is published and the objects of
the models bucket that no remaining model names are deleted (an object another model names
stays). Each node's worker drops the model's files from its cache when it sees the event
(``services/worker/cache_upkeep.py``).

What the cluster knows is the projection, brought up to the log's end with the model events
still in the log: a model added a moment ago, not projected yet, is known (and its objects
are not deleted under it).
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from nats.js import JetStreamContext
from pydantic import ValidationError

from bus.publisher import Publisher
from bus.reader import read_stream
from bus.stores.object_store import delete_object
from bus.streams import EVENTS_STREAM, MODELS_BUCKET
from events.catalogue import Event, ModelRemoved, WeightFile, parse_event
from events.states import INSTANCE_ENDING
from events.subjects import aggregate_filter
from projectors.rows import ModelRow
from projectors.rules import fold
from projectors.state import ClusterState


class ModelNotKnown(LookupError):
    """The cluster knows no such model."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"the cluster knows no model {model_id!r}")
        self.model_id = model_id


class ModelInUse(RuntimeError):
    """A live instance uses the model: it is not removed."""

    def __init__(self, model_id: str, instances: list[str]) -> None:
        super().__init__(
            f"model {model_id!r} is used by live instance(s) {', '.join(instances)}: delete"
            " them first"
        )
        self.model_id = model_id
        self.instances = instances


@dataclass(frozen=True)
class Removal:
    event: ModelRemoved
    seq: int  # the event's stream sequence
    deleted: tuple[WeightFile, ...]  # the files whose objects left the bucket
    kept: tuple[WeightFile, ...]  # those another model names (their objects stay)


def live_instances(state: ClusterState, model_id: str) -> list[str]:
    """The instances of ``model_id`` that are wanted (requested, placed or waiting to be
    placed again), by id. Pure."""
    return sorted(
        i.instance_id
        for i in state.instances()
        if i.model_id == model_id and i.status not in INSTANCE_ENDING
    )


def weight_files(row: ModelRow) -> list[WeightFile]:
    return [WeightFile.model_validate(f) for f in row.files or []]


def unnamed_objects(
    files: Iterable[WeightFile], remaining: Iterable[ModelRow]
) -> tuple[list[WeightFile], list[WeightFile]]:
    """Of a removed model's ``files``: those whose object no ``remaining`` model names (to
    delete), and those whose object one does (to keep). Pure."""
    named = {f.object for row in remaining for f in weight_files(row)}
    gone: list[WeightFile] = []
    kept: list[WeightFile] = []
    seen: set[str] = set()
    for f in files:
        if f.object in seen:  # a model may name one object twice (two names, same bytes)
            continue
        seen.add(f.object)
        (kept if f.object in named else gone).append(f)
    return gone, kept


async def known_models(js: JetStreamContext, projection: ClusterState) -> ClusterState:
    """``projection`` with every model event still in the log folded on top (a model's row is
    what its last event says, so folding events the projection has seen again changes
    nothing)."""
    events: list[Event] = []
    async for msg in read_stream(js, EVENTS_STREAM, aggregate_filter("model")):
        try:
            events.append(parse_event(msg.data))
        except ValidationError:
            continue  # dead-lettered by the projector: no fact of the projection either
    return fold(events, projection.copy())


async def remove_model(
    js: JetStreamContext,
    projection: ClusterState,
    model_id: str,
    *,
    origin: str | None = None,
    reason: str = "",
    deleting: Collection[str] = (),
) -> Removal:
    """Remove ``model_id`` (see the module). ``deleting``: instances whose deletion the caller
    has just asked for, which the projection may not show yet. Raises ``ModelNotKnown`` or
    ``ModelInUse``."""
    model = (await known_models(js, projection)).model(model_id)
    if model is None:
        raise ModelNotKnown(model_id)
    users = [i for i in live_instances(projection, model_id) if i not in deleting]
    if users:
        raise ModelInUse(model_id, users)
    event = ModelRemoved(
        model_id=model_id,
        origin=origin or f"shoal-cli@{socket.gethostname()}",
        reason=reason,
    )
    ack = await Publisher(js).publish(event)
    # Read again after the event: a model added meanwhile that names one of these objects
    # keeps it.
    remaining = (await known_models(js, projection)).models()
    gone, kept = unnamed_objects(weight_files(model), remaining)
    deleted = [f for f in gone if await delete_object(js, MODELS_BUCKET, f.object) is not None]
    return Removal(event=event, seq=ack.seq, deleted=tuple(deleted), kept=tuple(kept))
