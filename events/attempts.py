"""A task's attempts, and which of their chunks and outcomes count: the fencing of a runner
that was thought lost but was only stalled.

A task is served by one attempt at a time: its first run (attempt 0), then each continuation
(``TaskCreated.resume.attempt``: 1, 2, ...), published when the runner serving the attempt
before was thought lost (``services/resume.py``). A runner that was only stalled (SIGSTOP,
swap, a paused VM) wakes up holding an older attempt: it looks for a newer one before each
group of chunks it publishes and stops once superseded (``services/runner/fence.py``). The
chunks and outcome an attempt published before its runner saw it was superseded are kept
apart by the readers (the API, the next continuation): every chunk and outcome says its
attempt, and the functions here say which count.

An attempt ``n`` that continued after ``start`` tokens owns the chunk indexes from ``start``
on; the ones before it belong to the attempts before it, each from its own start. So, per
index, the chunk of the highest attempt counts, except an older attempt's at or after the
newest attempt's start (made after that attempt's tokens were read: a mix of two samplings).
Chunks and outcomes logged before attempts were recorded (``attempt`` None) always count, and
rank below any attempt: such a log reads as it did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from events.catalogue import ChunkGenerated, TaskCompleted, TaskCreated, TaskFailed

FIRST_ATTEMPT = 0


@dataclass(frozen=True, order=True)
class Attempt:
    """An attempt of a task: its number (0: the first run), and the first chunk index it
    publishes (the tokens it was given to go on from)."""

    number: int
    start: int = 0


def attempt_of(task: TaskCreated) -> Attempt:
    """The attempt a ``TaskCreated`` starts: the first run, or a continuation."""
    if task.resume is None:
        return Attempt(FIRST_ATTEMPT, 0)
    return Attempt(task.resume.attempt, len(task.resume.tokens))


def seen_in(chunk: ChunkGenerated) -> Attempt | None:
    """What a chunk tells of its attempt when its ``TaskCreated`` was not seen: that it exists
    and starts at this index or before."""
    return None if chunk.attempt is None else Attempt(chunk.attempt, chunk.idx)


def newest(a: Attempt | None, b: Attempt | None) -> Attempt | None:
    """The newer of two attempts (None: not known). Of two views of one attempt, the earlier
    start: a chunk only bounds it, its ``TaskCreated`` says it."""
    if a is None or b is None:
        return a or b
    if a.number != b.number:
        return a if a.number > b.number else b
    return a if a.start <= b.start else b


def superseded(mine: int, latest: Attempt | None) -> bool:
    """Whether the runner of attempt ``mine`` must stop: a newer attempt of its task exists."""
    return latest is not None and latest.number > mine


def counts(chunk: ChunkGenerated, latest: Attempt | None) -> bool:
    """Whether a chunk can belong to the task's answer, the newest attempt being ``latest``:
    not when an older attempt made it at or after the newest one's start."""
    if chunk.attempt is None or latest is None or chunk.attempt >= latest.number:
        return True
    return chunk.idx < latest.start


def _rank(chunk: ChunkGenerated) -> int:
    return -1 if chunk.attempt is None else chunk.attempt


def better(chunk: ChunkGenerated, than: ChunkGenerated | None) -> bool:
    """Whether ``chunk`` replaces ``than`` at its index: a higher attempt does; of one attempt
    (or none recorded), the one read last."""
    return than is None or _rank(chunk) >= _rank(than)


def kept_chunks(
    chunks: Iterable[ChunkGenerated], latest: Attempt | None = None
) -> dict[int, ChunkGenerated]:
    """The task's answer as the log holds it, by index: at each, the counting chunk of the
    highest attempt (see the module's doc). ``latest``: the newest attempt as its
    ``TaskCreated`` says (the chunks' own attempts are taken into account too)."""
    chunks = list(chunks)
    for chunk in chunks:
        latest = newest(latest, seen_in(chunk))
    kept: dict[int, ChunkGenerated] = {}
    for chunk in chunks:
        if counts(chunk, latest) and better(chunk, kept.get(chunk.idx)):
            kept[chunk.idx] = chunk
    return kept


def outcome_counts(outcome: TaskCompleted | TaskFailed, latest: Attempt | None) -> bool:
    """Whether an outcome ends the task: not one of an attempt older than the newest."""
    return outcome.attempt is None or latest is None or outcome.attempt >= latest.number


def chunk_msg_id(task_id: str, attempt: int, idx: int) -> str:
    """A chunk's ``Nats-Msg-Id``: one per task, attempt and index, whoever sends it again."""
    return f"chunk:{task_id}:{attempt}:{idx}"


def scored_msg_id(task_id: str, attempt: int, start: int) -> str:
    """A ``PromptScored`` slice's ``Nats-Msg-Id``."""
    return f"scored:{task_id}:{attempt}:{start}"


def outcome_msg_id(task_id: str, attempt: int | None) -> str:
    """The ``Nats-Msg-Id`` of an attempt's outcome, the same from its runner and from the
    worker that fails it when the runner died, so that an attempt has one outcome. The first
    run's is ``done:<task>``, as before attempts were recorded."""
    if attempt is None or attempt == FIRST_ATTEMPT:
        return f"done:{task_id}"
    return f"done:{task_id}:{attempt}"
