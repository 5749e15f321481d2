"""What a worker publishes for a task its lost runner left unfinished: the continuation, with the
tokens of the stored chunks, or the failure where it cannot go on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from events.catalogue import ChunkGenerated, Resume, TaskCreated, TaskFailed
from events.records import SamplingParams
from services.resume import (
    MAX_RESUMES,
    Logged,
    continuation,
    generated_tokens,
    message_id,
    still_streaming,
    superseded_since,
)

TASK = TaskCreated(
    task_id="t1",
    model_id="m",
    origin="api",
    prompt="hi",
    kind="completion",
    params=SamplingParams(max_tokens=50, temperature=0),
)


def chunk(
    idx: int, token: int | None = None, finish: bool = False, attempt: int | None = None
) -> ChunkGenerated:
    return ChunkGenerated(
        task_id="t1",
        idx=idx,
        text=f"<{idx}>",
        origin="r",
        token_id=None if finish else (token if token is not None else 100 + idx),
        finish_reason="stop" if finish else None,
        attempt=attempt,
    )


NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def logged(
    created: TaskCreated | None, chunks: list[ChunkGenerated], cancelled: bool = False
) -> Logged:
    return Logged("t1", "m", created, chunks, cancelled)


def lost(
    created: TaskCreated | None, chunks: list[ChunkGenerated], cancelled: bool = False
) -> TaskCreated | TaskFailed:
    return continuation(
        logged(created, chunks, cancelled),
        runner_id="r0",
        cause="killed by SIGKILL",
        origin="node-a",
        at=NOW,
    )


def test_the_tokens_are_the_stored_chunks_from_zero_without_a_gap() -> None:
    assert generated_tokens([chunk(2), chunk(0), chunk(1)]) == ([100, 101, 102], False)
    # A gap: what follows it is not known to be the task's next tokens.
    assert generated_tokens([chunk(0), chunk(2)]) == ([100], False)
    assert generated_tokens([]) == ([], False)
    assert generated_tokens([chunk(0), chunk(1, finish=True)]) == ([100], True)


def test_a_lost_task_is_continued_after_its_stored_tokens() -> None:
    out = lost(TASK, [chunk(0), chunk(1), chunk(2)])
    assert isinstance(out, TaskCreated) and out.resume is not None
    why = "the runner serving this task killed by SIGKILL"
    assert out.resume == Resume(attempt=1, tokens=[100, 101, 102], runner_id="r0", reason=why)
    # The task as asked, on its own subject: the model's replicas pull it as any task.
    assert out.model_dump(exclude={"resume", "origin", "event_id", "ts"}) == TASK.model_dump(
        exclude={"resume", "origin", "event_id", "ts"}
    )
    assert out.subject == TASK.subject and out.origin == "node-a" and out.ts == NOW
    # One continuation per attempt, whoever publishes it.
    assert message_id(out) == "resume:t1:1"
    again = lost(TASK, [chunk(0), chunk(1), chunk(2)])
    assert isinstance(again, TaskCreated) and again.event_id == out.event_id


def test_a_continuation_lost_again_counts_its_attempts_up_to_the_limit() -> None:
    resumed = TASK.model_copy(update={"resume": Resume(attempt=1, tokens=[100])})
    second = lost(resumed, [chunk(0), chunk(1)])
    assert isinstance(second, TaskCreated) and second.resume is not None
    assert second.resume.attempt == 2 and second.resume.tokens == [100, 101]
    assert message_id(second) == "resume:t1:2"
    last = TASK.model_copy(update={"resume": Resume(attempt=MAX_RESUMES, tokens=[100])})
    failed = lost(last, [chunk(0)])
    # The lost attempt's outcome, under the id its runner's own would have had.
    assert isinstance(failed, TaskFailed) and failed.attempt == MAX_RESUMES
    assert message_id(failed) == f"done:t1:{MAX_RESUMES}"
    assert failed.error == (
        f"the runner serving this task killed by SIGKILL (resumed {MAX_RESUMES} times already)"
    )


def test_a_cancelled_ended_or_unknown_task_fails_as_before() -> None:
    for out in (
        lost(TASK, [chunk(0)], cancelled=True),
        lost(TASK, [chunk(0), chunk(1, finish=True)]),
        lost(None, []),
    ):
        assert isinstance(out, TaskFailed) and out.runner_id == "r0"
        assert out.error == "the runner serving this task killed by SIGKILL"


def test_a_task_whose_chunks_still_come_still_has_its_runner() -> None:
    fresh = chunk(3).model_copy(update={"ts": NOW - timedelta(seconds=0.5)})
    stale = chunk(3).model_copy(update={"ts": NOW - timedelta(seconds=5)})
    assert still_streaming(logged(TASK, [fresh]), NOW)
    assert not still_streaming(logged(TASK, [stale]), NOW)
    assert not still_streaming(logged(TASK, []), NOW)  # none yet: it is not known to go on


def test_a_continuation_goes_on_from_the_newest_attempts_tokens() -> None:
    # Attempt 1 went on after 2 tokens; attempt 0, stalled, then published its own 2 and 3,
    # and attempt 1 was lost after its own 2, 3 and 4.
    first = TASK.model_copy(update={"resume": Resume(attempt=1, tokens=[100, 101])})
    stored = [chunk(0, attempt=0), chunk(1, attempt=0), chunk(2, 900, attempt=0)]
    stored += [chunk(2, 200, attempt=1), chunk(3, 201, attempt=1), chunk(3, 901, attempt=0)]
    stored += [chunk(4, 202, attempt=1)]
    out = lost(first, stored)
    assert isinstance(out, TaskCreated) and out.resume is not None
    assert out.resume.attempt == 2 and out.resume.tokens == [100, 101, 200, 201, 202]
    # Nor does a superseded attempt's last chunk end the task.
    ended_late = [*stored[:2], chunk(2, finish=True, attempt=0), chunk(2, 200, attempt=1)]
    assert isinstance(lost(first, ended_late), TaskCreated)


def test_a_lost_runner_that_held_an_older_attempt_leaves_nothing_to_do() -> None:
    second = TASK.model_copy(update={"resume": Resume(attempt=2, tokens=[100])})
    assert superseded_since(logged(second, []), 1)  # stalled, continued, then killed
    assert not superseded_since(logged(second, []), 2)
    assert not superseded_since(logged(second, []), None)  # not known: as before
    assert not superseded_since(logged(None, []), 0)
