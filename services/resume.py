"""A task whose runner was lost mid-generation goes on from the log instead of failing.

Every token a runner generated is a stored chunk, and the task's prompt is its ``TaskCreated``.
When a runner dies with tasks unfinished, its worker publishes each task's continuation: the
``TaskCreated`` again, with ``resume`` (the tokens of its stored chunks, idx 0 on, and how many
times it has been resumed). It goes on the task's own subject, so the model's replicas pull it
as any task (the runner restarted, or another replica), and the next runner prefills the
prompt and those tokens and goes on at the next chunk index: the client's stream pauses and
goes on. Its message id, ``resume:<task>:<attempt>``, makes one continuation of a failure
however many times it is published.

A node that times out is not known to have lost its runners: one whose worker died finishes
what it serves (its worker's death sends it SIGTERM), and a planner continues only the tasks
whose chunks stopped coming (for ``QUIET_S``).

Not continued, but failed as before: a task that was cancelled, one whose last chunk was stored
(it ended; only its outcome was lost), and one resumed ``MAX_RESUMES`` times already.

The tokens read are the newest attempt's (``events/attempts.py``): a runner that was only stalled
may have published chunks of an attempt continued since, and those are not the task's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from events.attempts import Attempt, attempt_of, kept_chunks, outcome_msg_id
from events.catalogue import (
    ChunkGenerated,
    Resume,
    TaskCancelled,
    TaskCreated,
    TaskFailed,
    parse_event,
)

MAX_RESUMES = 3
# A task of a timed-out node whose chunks came this recently still has its runner.
QUIET_S = 2.0


def generated_tokens(
    chunks: Iterable[ChunkGenerated], latest: Attempt | None = None
) -> tuple[list[int], bool]:
    """The tokens of the chunks stored from idx 0 on without a gap, and whether the last
    chunk (the one with a finish reason) is among them: the chunks that count, ``latest``
    being the newest attempt (``events.attempts.kept_chunks``)."""
    by_idx = kept_chunks(chunks, latest)
    tokens: list[int] = []
    while (chunk := by_idx.get(len(tokens))) is not None:
        if chunk.finish_reason is not None:
            return tokens, True
        if chunk.token_id is None:
            break
        tokens.append(chunk.token_id)
    return tokens, False


@dataclass(frozen=True)
class Logged:
    """What the log holds of a task a runner left: its latest ``TaskCreated`` (None: no
    generation task of that id is in the log), its stored chunks, whether it was cancelled."""

    task_id: str
    model_id: str
    created: TaskCreated | None
    chunks: list[ChunkGenerated]
    cancelled: bool


def continuation(
    task: Logged,
    *,
    runner_id: str,
    cause: str,
    origin: str,
    at: datetime,
    max_resumes: int = MAX_RESUMES,
) -> TaskCreated | TaskFailed:
    """What follows the loss of ``task``'s runner: its continuation (published ``at``), or its
    failure."""
    created = task.created
    error = f"the runner serving this task {cause}"
    lost = attempt_of(created) if created is not None else None
    attempt = (lost.number if lost is not None else 0) + 1
    tokens, ended = generated_tokens(task.chunks, lost)
    if created is None or task.cancelled or ended or attempt > max_resumes:
        if attempt > max_resumes:
            error += f" (resumed {max_resumes} times already)"
        return TaskFailed(
            task_id=task.task_id,
            model_id=task.model_id,
            origin=origin,
            runner_id=runner_id,
            error=error,
            # The lost attempt's outcome (its runner's would have had the same message id).
            attempt=lost.number if lost is not None else None,
        )
    resume = Resume(attempt=attempt, tokens=tokens, runner_id=runner_id, reason=error)
    return TaskCreated.model_validate(
        created.model_dump()
        | {"resume": resume, "origin": origin, "ts": at}
        | {"event_id": f"resume-{created.task_id}-{attempt}"}
    )


def message_id(event: TaskCreated | TaskFailed) -> str:
    """The same for every publisher of one outcome: a continuation's is per attempt, and a
    failure's is the runner's own outcome's (if that got out, this is dropped)."""
    if isinstance(event, TaskCreated) and event.resume is not None:
        return f"resume:{event.task_id}:{event.resume.attempt}"
    return outcome_msg_id(event.task_id, event.attempt if isinstance(event, TaskFailed) else None)


def superseded_since(task: Logged, attempt: int | None) -> bool:
    """Whether the attempt a lost runner held (None: not known) was continued since: its
    loss is then nothing to act on (the task goes on with the newer attempt)."""
    return (
        attempt is not None
        and task.created is not None
        and attempt_of(task.created).number > attempt
    )


def describe(outcome: TaskCreated | TaskFailed) -> str:
    if isinstance(outcome, TaskCreated) and outcome.resume is not None:
        r = outcome.resume
        return f"resumed after {len(r.tokens)} tokens (attempt {r.attempt})"
    return f"failed: {outcome.error}" if isinstance(outcome, TaskFailed) else "created"


def still_streaming(task: Logged, now: datetime, within_s: float = QUIET_S) -> bool:
    """Whether the task's newest stored chunk is younger than ``within_s``: its runner goes on
    (a runner whose worker died finishes what it serves before it exits)."""
    return any(now - c.ts < timedelta(seconds=within_s) for c in task.chunks)


async def read_logged(js: JetStreamContext, task_id: str, model_id: str) -> Logged:
    ids = (model_id, task_id)
    try:
        stored = await js.get_last_msg(EVENTS_STREAM, TaskCreated.subject_for(*ids))
        created = parse_event(stored.data or b"")
    except NotFoundError:
        created = None
    chunks = [
        event
        async for m in read_stream(js, CHUNKS_STREAM, ChunkGenerated.subject_for(task_id))
        if isinstance(event := parse_event(m.data), ChunkGenerated)
    ]
    try:
        await js.get_last_msg(EVENTS_STREAM, TaskCancelled.subject_for(*ids))
        cancelled = True
    except NotFoundError:
        cancelled = False
    created = created if isinstance(created, TaskCreated) else None
    return Logged(task_id, model_id, created, chunks, cancelled)
