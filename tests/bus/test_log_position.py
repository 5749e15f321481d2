"""The pure check of a reader's position against the log."""

from __future__ import annotations

from bus.log_position import check_position, digest


def test_a_reader_at_the_log_or_behind_it_is_fine() -> None:
    d = digest(b"event 7")
    assert check_position(7, d, 7, d).lost is False
    assert check_position(7, d, 10, d).behind == 3
    assert check_position(0, "", 5, None).behind == 5  # nothing applied yet
    assert check_position(7, "", 10, digest(b"other")).lost is False  # kept none: cannot tell
    assert check_position(7, d, 10, None).lost is False  # aged out: cannot tell


def test_a_log_that_ends_before_the_reader_lost_its_tail() -> None:
    verdict = check_position(12, digest(b"e12"), 8, None)
    assert verdict.lost
    assert "#9..#12" in verdict.dropped and "#8" in verdict.dropped


def test_another_event_under_the_readers_number_is_a_lost_tail() -> None:
    verdict = check_position(12, digest(b"e12"), 15, digest(b"newer"))
    assert verdict.lost
    assert "#12" in verdict.dropped and "#15" in verdict.dropped


def test_digests_are_short_and_stable() -> None:
    assert digest(b"x") == digest(b"x") != digest(b"y")
    assert len(digest(b"x")) == 32
