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
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.events import ChunkGenerated, Resume, TaskCreated, TaskFailed, parse_event, utc_now
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from bus.subjects import chunk_subject, event_subject

MAX_RESUMES = 3
# A task of a timed-out node whose chunks came this recently still has its runner.
QUIET_S = 2.0


def generated_tokens(chunks: Iterable[ChunkGenerated]) -> tuple[list[int], bool]:
    """The tokens of the chunks stored from idx 0 on without a gap, and whether the last
    chunk (the one with a finish reason) is among them."""
    by_idx = {c.idx: c for c in chunks}
    tokens: list[int] = []
    while (chunk := by_idx.get(len(tokens))) is not None:
        if chunk.finish_reason is not None:
            return tokens, True
        if chunk.token_id is None:
            break
        tokens.append(chunk.token_id)
    return tokens, False


def continuation(
    created: TaskCreated,
    chunks: Iterable[ChunkGenerated],
    *,
    cancelled: bool,
    runner_id: str,
    cause: str,
    origin: str,
    max_resumes: int = MAX_RESUMES,
) -> TaskCreated | TaskFailed:
    """What follows the loss of ``created``'s runner: its continuation, or its failure."""
    attempt = (created.resume.attempt if created.resume is not None else 0) + 1
    tokens, ended = generated_tokens(chunks)
    error = f"the runner serving this task {cause}"
    if cancelled or ended or attempt > max_resumes:
        if attempt > max_resumes:
            error += f" (resumed {max_resumes} times already)"
        return TaskFailed(task_id=created.task_id, model_id=created.model_id, origin=origin,
                          runner_id=runner_id, error=error)  # fmt: skip
    resume = Resume(attempt=attempt, tokens=tokens, runner_id=runner_id, reason=error)
    return TaskCreated.model_validate(
        created.model_dump() | {"resume": resume, "origin": origin, "ts": utc_now()}
        | {"event_id": f"resume-{created.task_id}-{attempt}"}
    )  # fmt: skip


def message_id(event: TaskCreated | TaskFailed) -> str:
    """The same for every publisher of one outcome: a continuation's is per attempt, and a
    failure's is the runner's own outcome's (if that got out, this is dropped)."""
    if isinstance(event, TaskCreated) and event.resume is not None:
        return f"resume:{event.task_id}:{event.resume.attempt}"
    return f"done:{event.task_id}"


def still_streaming(chunks: Iterable[ChunkGenerated], now: datetime, within_s: float) -> bool:
    """Whether the task's newest stored chunk is younger than ``within_s``: its runner goes on
    (a runner whose worker died finishes what it serves before it exits)."""
    return any(now - c.ts < timedelta(seconds=within_s) for c in chunks)


async def after_lost_runner(
    js: JetStreamContext,
    task_id: str,
    model_id: str,
    *,
    runner_id: str,
    cause: str,
    origin: str,
    quiet_s: float | None = None,
) -> TaskCreated | TaskFailed | None:
    """The continuation (or failure) of a task left unfinished by a runner, from the log.
    With ``quiet_s`` (a runner not known to be dead): None while the task's chunks still come
    (``still_streaming``)."""  # fmt: skip
    subject = event_subject("task", (model_id, task_id), "TaskCreated")
    error = f"the runner serving this task {cause}"
    try:
        created = parse_event((await js.get_last_msg(EVENTS_STREAM, subject)).data or b"")
    except NotFoundError:
        created = None
    if not isinstance(created, TaskCreated):  # not in the log (or not a generation task)
        return TaskFailed(task_id=task_id, model_id=model_id, origin=origin,
                          runner_id=runner_id, error=error)  # fmt: skip
    chunks = [
        event
        async for m in read_stream(js, CHUNKS_STREAM, chunk_subject(task_id))
        if isinstance(event := parse_event(m.data), ChunkGenerated)
    ]
    if quiet_s is not None and still_streaming(chunks, utc_now(), quiet_s):
        return None
    try:
        await js.get_last_msg(EVENTS_STREAM, event_subject("task", (model_id, task_id),
                                                           "TaskCancelled"))  # fmt: skip
        cancelled = True
    except NotFoundError:
        cancelled = False
    return continuation(created, chunks, cancelled=cancelled, runner_id=runner_id, cause=cause,
                        origin=origin)  # fmt: skip
