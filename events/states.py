"""Where things stand: the words events, projection rows, the planner, the API and the
dashboard's JSON share, as ``Literal`` types, so that mypy (strict equality included) refuses
a misspelt state wherever it is written or compared."""

from __future__ import annotations

from typing import Literal, get_args

# A node: joined and heartbeating; gone cleanly (NodeLeft); silent past its time-out.
NodeStatus = Literal["online", "left", "timed_out"]
# An instance: asked for, placed (its runners may still be loading), refused by placement,
# being deleted (its runners stop), deleted.
InstanceStatus = Literal["requested", "placed", "rejected", "deleting", "deleted"]
# A runner process, as it reports itself (RunnerStateChanged).
RunnerState = Literal["Assigned", "Downloading", "Loading", "Ready", "Running", "Failed", "Stopped"]
# A task: queued, generating, and its three ends.
TaskStatus = Literal["pending", "running", "completed", "failed", "cancelled"]
# A stored response of the Responses API (OpenAI's words); its row's, once it is deleted too.
ResponseStatus = Literal["completed", "incomplete", "failed", "in_progress", "cancelled", "queued"]
StoredResponseStatus = Literal[ResponseStatus, "deleted"]

NODE_STATUSES: tuple[NodeStatus, ...] = get_args(NodeStatus)
INSTANCE_STATUSES: tuple[InstanceStatus, ...] = get_args(InstanceStatus)
RUNNER_STATES: tuple[RunnerState, ...] = get_args(RunnerState)
TASK_STATUSES: tuple[TaskStatus, ...] = get_args(TaskStatus)
# A task in one of these has ended: nothing more will happen to it.
TASK_ENDED: frozenset[TaskStatus] = frozenset({"completed", "failed", "cancelled"})
# A runner in one of these takes tasks (or, a later pipeline stage, a head's work).
SERVING: frozenset[RunnerState] = frozenset({"Ready", "Running"})
# A runner in one of these is on its way to serving.
STARTING: frozenset[RunnerState] = frozenset({"Assigned", "Downloading", "Loading"})
# A runner in one of these has ended (it may be restarted under the same id).
RUNNER_ENDED: frozenset[RunnerState] = frozenset({"Failed", "Stopped"})
# An instance in one of these is wanted: placed, or waiting for the planner.
INSTANCE_LIVE: frozenset[InstanceStatus] = frozenset({"requested", "placed"})
# An instance in one of these waits for a placement (a first one, or again after a refusal).
INSTANCE_UNPLACED: frozenset[InstanceStatus] = frozenset({"requested", "rejected"})
# An instance in one of these is shown as current (not on its way out).
INSTANCE_CURRENT: frozenset[InstanceStatus] = INSTANCE_LIVE | {"rejected"}
# An instance in one of these is going or gone.
INSTANCE_ENDING: frozenset[InstanceStatus] = frozenset({"deleting", "deleted"})
