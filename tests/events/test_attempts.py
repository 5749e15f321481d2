"""Which attempt of a task is the newest, and which chunks and outcomes count (pure)."""

from __future__ import annotations

from events.attempts import (
    Attempt,
    attempt_of,
    better,
    chunk_msg_id,
    counts,
    kept_chunks,
    newest,
    outcome_counts,
    outcome_msg_id,
    seen_in,
    superseded,
)
from events.catalogue import ChunkGenerated, Resume, TaskCompleted, TaskCreated, TaskFailed
from events.records import Timings, Usage

TASK = TaskCreated(task_id="t", model_id="m", origin="api", prompt="hi", kind="completion")


def resumed(attempt: int, tokens: int) -> TaskCreated:
    return TASK.model_copy(update={"resume": Resume(attempt=attempt, tokens=[7] * tokens)})


def chunk(idx: int, attempt: int | None, text: str = "", final: bool = False) -> ChunkGenerated:
    return ChunkGenerated(
        task_id="t",
        idx=idx,
        text=text or f"{attempt}:{idx}",
        token_id=None if final else 100 + idx,
        finish_reason="stop" if final else None,
        attempt=attempt,
        origin="r",
    )


def texts(kept: dict[int, ChunkGenerated]) -> list[str]:
    return [kept[i].text for i in sorted(kept)]


def test_a_tasks_attempts_are_its_first_run_and_its_continuations() -> None:
    assert attempt_of(TASK) == Attempt(0, 0)
    assert attempt_of(resumed(2, 5)) == Attempt(2, 5)  # goes on at chunk 5


def test_the_newest_attempt_is_the_highest_and_a_chunk_only_bounds_its_start() -> None:
    assert newest(Attempt(0), Attempt(1, 3)) == Attempt(1, 3)
    assert newest(Attempt(2, 4), Attempt(1, 3)) == Attempt(2, 4)
    assert newest(None, Attempt(1, 3)) == Attempt(1, 3)
    assert newest(Attempt(1, 3), None) == Attempt(1, 3)
    assert newest(None, None) is None
    # A chunk of attempt 1 at index 9: attempt 1 exists and started at 9 or before; its
    # TaskCreated says exactly where.
    seen = seen_in(chunk(9, 1))
    assert seen == Attempt(1, 9)
    assert newest(seen, Attempt(1, 3)) == Attempt(1, 3)
    assert newest(Attempt(1, 3), seen) == Attempt(1, 3)
    assert seen_in(chunk(9, None)) is None


def test_a_runner_is_superseded_by_a_newer_attempt_only() -> None:
    assert superseded(0, Attempt(1, 0))
    assert not superseded(1, Attempt(1, 0))
    assert not superseded(2, Attempt(1, 0))
    assert not superseded(0, None)


def test_an_older_attempts_chunks_count_only_before_the_newest_ones_start() -> None:
    latest = Attempt(1, 3)
    assert counts(chunk(2, 0), latest)  # before the continuation: the tokens it was given
    assert not counts(chunk(3, 0), latest)  # made after those were read: another sampling
    assert not counts(chunk(9, 0), latest)
    assert counts(chunk(3, 1), latest) and counts(chunk(9, 2), latest)
    assert counts(chunk(9, None), latest)  # logged before attempts were: as before
    assert counts(chunk(9, 0), None)


def test_a_higher_attempt_replaces_a_lower_one_and_one_attempt_the_one_read_last() -> None:
    assert better(chunk(3, 1), chunk(3, 0))
    assert not better(chunk(3, 0), chunk(3, 1))
    assert better(chunk(3, 1, "again"), chunk(3, 1))
    assert better(chunk(3, 0), chunk(3, None))
    assert better(chunk(3, None), None)


def test_the_answer_in_the_log_is_the_newest_attempts_view() -> None:
    # Attempt 0 published 0..4, then stalled; attempt 1 went on from 3 (its tokens were read
    # when only 0..2 were stored); attempt 0 woke and published 5 before it saw attempt 1.
    log = [chunk(i, 0) for i in range(5)] + [chunk(3, 1), chunk(4, 1), chunk(5, 0)]
    log += [chunk(5, 1), chunk(6, 1, final=True)]
    kept = kept_chunks(log, Attempt(1, 3))
    assert texts(kept) == ["0:0", "0:1", "0:2", "1:3", "1:4", "1:5", "1:6"]
    # The same without the TaskCreated of attempt 1: its first chunk bounds its start.
    assert texts(kept_chunks(log)) == texts(kept)
    # Read in another order, the same.
    assert texts(kept_chunks(reversed(log), Attempt(1, 3))) == texts(kept)


def test_a_continued_continuation_keeps_each_attempts_own_part() -> None:
    log = [chunk(0, 0), chunk(1, 0), chunk(2, 0)]  # then attempt 0 was lost
    log += [chunk(2, 1), chunk(3, 1)]  # attempt 1 from 2 (attempt 0's 2 came too late)
    log += [chunk(4, 2), chunk(5, 2)]  # attempt 2 from 4
    assert texts(kept_chunks(log, Attempt(2, 4))) == ["0:0", "0:1", "1:2", "1:3", "2:4", "2:5"]


def test_a_log_from_before_attempts_reads_as_it_did() -> None:
    # No attempts recorded: per index the chunk read last, whatever the continuation says.
    log = [chunk(0, None, "a"), chunk(1, None, "b"), chunk(1, None, "B"), chunk(2, None, "c")]
    assert texts(kept_chunks(log, Attempt(1, 1))) == ["a", "B", "c"]
    assert texts(kept_chunks(log)) == ["a", "B", "c"]


def test_an_older_attempts_outcome_does_not_end_the_task() -> None:
    done = TaskCompleted(
        task_id="t",
        model_id="m",
        origin="r",
        runner_id="r",
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1),
        timings=Timings(ttft_ms=1, tokens_per_s=1, total_ms=1),
        attempt=0,
    )
    assert not outcome_counts(done, Attempt(1, 0))
    assert outcome_counts(done, Attempt(0, 0))
    assert outcome_counts(done.model_copy(update={"attempt": None}), Attempt(1, 0))
    failed = TaskFailed(task_id="t", model_id="m", origin="w", error="x", attempt=2)
    assert outcome_counts(failed, Attempt(1, 0)) and outcome_counts(failed, None)


def test_message_ids_are_per_task_attempt_and_index() -> None:
    assert chunk_msg_id("t", 1, 7) == "chunk:t:1:7"
    assert outcome_msg_id("t", 0) == outcome_msg_id("t", None) == "done:t"  # as before
    assert outcome_msg_id("t", 2) == "done:t:2"


def test_old_events_without_an_attempt_still_parse() -> None:
    old = b'{"type":"ChunkGenerated","task_id":"t","idx":0,"text":"x","origin":"r"}'
    assert ChunkGenerated.model_validate_json(old).attempt is None
