"""The outcome of an attempt continued since (its runner was stalled, not lost) does not end the
task in the projection; the newest attempt's does, and outcomes logged before attempts were
recorded end it as before."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from events.catalogue import Resume, TaskCompleted, TaskCreated, TaskFailed, TaskStarted
from events.records import Timings, Usage
from projectors.rules import fold

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CREATED = TaskCreated(task_id="t", model_id="m", origin="api", ts=T0, owner="k")
STARTED = TaskStarted(task_id="t", model_id="m", origin="a", ts=T0, runner_id="r0", instance_id="i")
RESUMED = CREATED.model_copy(update={"resume": Resume(attempt=1, tokens=[5]), "origin": "n"})


def completed(attempt: int | None, tokens: int) -> TaskCompleted:
    return TaskCompleted(
        task_id="t",
        model_id="m",
        origin="a",
        ts=T0 + timedelta(seconds=tokens),
        runner_id=f"r{attempt}",
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=tokens),
        timings=Timings(ttft_ms=1.0, tokens_per_s=1.0, total_ms=1.0),
        attempt=attempt,
    )


def test_an_older_attempts_outcome_leaves_the_task_to_the_newer_one() -> None:
    stale_failure = TaskFailed(task_id="t", model_id="m", origin="a", error="x", attempt=0)
    state = fold([CREATED, STARTED, RESUMED, completed(0, 9), stale_failure])
    t = state.task("t")
    assert t is not None and (t.status, t.resumes) == ("pending", 1)
    assert state.usage("k", "m") is None  # nothing counted for the superseded attempt
    state = fold([CREATED, STARTED, RESUMED, completed(0, 9), completed(1, 4)])
    t = state.task("t")
    assert t is not None and (t.status, t.completion_tokens, t.runner_id) == ("completed", 4, "r1")
    used = state.usage("k", "m")
    assert used is not None and (used.requests, used.completion_tokens) == (1, 4)


def test_outcomes_without_an_attempt_end_the_task_as_before() -> None:
    t = fold([CREATED, STARTED, RESUMED, completed(None, 9)]).task("t")
    assert t is not None and t.status == "completed"
    failed = TaskFailed(task_id="t", model_id="m", origin="w", error="x")
    t = fold([CREATED, STARTED, RESUMED, failed]).task("t")
    assert t is not None and t.status == "failed"
