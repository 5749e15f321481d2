"""The live event feed's buffer per client: bounded in bytes, and an overflow that says so."""

from __future__ import annotations

import json

import pytest

from api.cluster.event_feed import OVERFLOW_CODE, FeedBuffer, overflow_event
from api.config import ApiConfig
from events.units import MiB


def test_items_come_out_in_order_and_their_bytes_are_counted() -> None:
    buffer: FeedBuffer[str] = FeedBuffer(10)
    assert buffer.offer("a", 4) and buffer.offer("b", 6)
    assert (len(buffer), buffer.size, buffer.overflowed) == (2, 10, False)  # the limit is room
    assert buffer.take() == "a" and buffer.size == 6
    assert buffer.offer("c", 4) and buffer.size == 10  # what was sent frees its bytes
    assert [buffer.take(), buffer.take(), buffer.take()] == ["b", "c", None]
    assert (len(buffer), buffer.size) == (0, 0)


def test_going_over_the_limit_overflows_drops_everything_and_refuses_the_rest() -> None:
    buffer: FeedBuffer[str] = FeedBuffer(10)
    assert buffer.offer("a", 6)
    assert not buffer.offer("b", 5)
    # Nothing is kept for a client that is let go: its memory is freed at once.
    assert (buffer.overflowed, len(buffer), buffer.size, buffer.take()) == (True, 0, 0, None)
    assert not buffer.offer("c", 1)  # however small, and however empty the buffer is now
    assert buffer.take() is None


def test_an_item_larger_than_the_limit_passes_only_alone() -> None:
    # Else a client that keeps up could never be sent an event that size.
    buffer: FeedBuffer[str] = FeedBuffer(10)
    assert buffer.offer("big", 25) and buffer.take() == "big"
    assert buffer.offer("big", 25) and not buffer.overflowed
    assert not buffer.offer("small", 1) and buffer.overflowed


def test_the_limit_is_positive() -> None:
    for limit in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            FeedBuffer[str](limit)


def test_the_overflow_event_is_an_error_in_the_apis_shape() -> None:
    text = overflow_event(8 * MiB)
    assert text.endswith("\n\n")
    lines = text.rstrip("\n").split("\n")
    assert lines[0] == "event: error" and len(lines) == 2 and lines[1].startswith("data: ")
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == OVERFLOW_CODE == "events_overflow"
    assert "cannot keep up" in error["message"] and "8 MiB" in error["message"]


def test_the_default_bound_is_8_mib() -> None:
    assert ApiConfig(nats_url="nats://x", db_url="sqlite://").events_buffer_bytes == 8 * MiB
