"""The transition rules: what each event changes in the projection.

``changes_for(state, event)`` is a pure function: it reads ``state``, never modifies it, and
returns the row changes the event implies. The SQL projector, replay and any in-memory fold all
use it, so they cannot disagree. Rules use only the event's own data (``ts``, never the wall
clock), so folding the same log always gives the same rows.

This module is the dispatch; the rules live with their aggregate (``nodes``, ``models``,
``instances`` and their runners, ``tasks``, ``responses``, ``keys``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import assert_never

from events.catalogue import (
    ChunkGenerated,
    EmbeddingsComputed,
    EmbeddingsRequested,
    Event,
    ImageGenerated,
    ImageStepped,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    KeyAdded,
    KeyRevoked,
    LogTailLost,
    ModelAdded,
    ModelEvicted,
    ModelRemoved,
    NodeJoined,
    NodeLeft,
    NodeTimedOut,
    PlacementRejected,
    PromptScored,
    ResourceProfiled,
    ResponseDeleted,
    ResponseStored,
    RunnerStateChanged,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskForgotten,
    TaskStarted,
)
from projectors.rules import instances, keys, models, nodes, responses, tasks
from projectors.state import Change, ClusterState


def changes_for(state: ClusterState, event: Event) -> list[Change]:
    # Exhaustive: mypy fails on assert_never below when an event type has no case, so a new
    # type gets a rule, or is declared projection-free, as it is added.
    match event:
        # The most frequent first: each case is an isinstance check.
        case TaskCreated():
            return tasks.task_created(state, event)
        case TaskStarted():
            return tasks.task_started(state, event)
        case TaskCompleted():
            return tasks.task_completed(state, event)
        case TaskFailed():
            return tasks.task_failed(state, event)
        case TaskCancelled():
            return tasks.task_cancelled(state, event)
        case EmbeddingsRequested():
            return tasks.embeddings_requested(state, event)
        case TaskForgotten():
            return tasks.task_forgotten(state, event)
        case ResourceProfiled():
            return nodes.resource_profiled(state, event)
        case RunnerStateChanged():
            return instances.runner_state_changed(state, event)
        case NodeJoined():
            return nodes.node_joined(state, event)
        case NodeLeft():
            return nodes.node_left(state, event)
        case NodeTimedOut():
            return nodes.node_timed_out(state, event)
        case ModelAdded():
            return models.model_added(state, event)
        case ModelRemoved():
            return models.model_removed(state, event)
        case InstanceRequested():
            return instances.instance_requested(state, event)
        case InstancePlaced():
            return instances.instance_placed(state, event)
        case PlacementRejected():
            return instances.placement_rejected(state, event)
        case InstanceDeleteRequested():
            return instances.instance_delete_requested(state, event)
        case InstanceDeleted():
            return instances.instance_deleted(state, event)
        case ResponseStored():
            return responses.response_stored(state, event)
        case ResponseDeleted():
            return responses.response_deleted(state, event)
        case KeyAdded():
            return keys.key_added(state, event)
        case KeyRevoked():
            return keys.key_revoked(state, event)
        case (
            ChunkGenerated()
            | PromptScored()
            | EmbeddingsComputed()
            | ImageStepped()
            | ImageGenerated()
        ):
            return []  # projection-free: the chunk stream's; the projection keeps task outcomes
        case ModelEvicted():
            return []  # projection-free: what one node's disk holds is that node's business
        case LogTailLost():
            return []  # projection-free: counted by type (/metrics), the projection rebuilt
        case _:
            assert_never(event)


def fold(events: Iterable[Event], state: ClusterState | None = None) -> ClusterState:
    """Apply ``events`` in order to ``state`` (a fresh one by default) and return it."""
    state = state if state is not None else ClusterState()
    for event in events:
        state.commit(changes_for(state, event))
    return state
