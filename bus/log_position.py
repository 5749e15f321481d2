"""Whether a reader's position still names the log's own events.

A reader that keeps its position (the projector's tracking row, a snapshot) keeps, with the
sequence it got to, a digest of the message it read there. A log that went back (a
nats-server's unsynced tail lost to a power cut, a store restored from a copy) shows it in one
of two ways: its last sequence is below the position, or the message now at the position is not
the one read there, its number having been given to a newer event. Either way what the reader
derived from the lost events is not the log's any more.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def digest(data: bytes) -> str:
    """What a reader keeps of the message at its position: 32 hex digits of its bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class PositionCheck:
    """The verdict: ``lost`` when the log went back behind ``seq``; ``behind`` is how many
    events the reader has still to read (0: at the end)."""

    lost: bool
    behind: int = 0
    dropped: str = ""  # for people: what the log lost, when it did


def check_position(
    seq: int, seq_digest: str, last_seq: int, digest_at: str | None
) -> PositionCheck:
    """A reader at ``seq`` (``seq_digest`` the digest it kept there, "" when it kept none)
    against the log: its last sequence and the digest of its message at ``seq`` (None when the
    log has no message there: aged out or removed, which says nothing either way)."""
    if seq <= 0:
        return PositionCheck(lost=False, behind=max(last_seq, 0))
    if last_seq < seq:
        return PositionCheck(
            lost=True,
            dropped=f"events #{last_seq + 1}..#{seq} are gone: the log ends at #{last_seq}",
        )
    if digest_at is not None and seq_digest and digest_at != seq_digest:
        return PositionCheck(
            lost=True,
            dropped=f"the event at #{seq} is not the one read there: the log lost events up to"
            f" #{seq} and stored newer ones under their numbers (it now ends at #{last_seq})",
        )
    return PositionCheck(lost=False, behind=last_seq - seq)


def consumer_past_end(delivered_seq: int, ack_floor_seq: int, stream_last_seq: int) -> bool:
    """Whether a durable consumer (its last delivered and acknowledged stream sequences)
    stands past the stream's end: its state outlived the tail the stream lost, and it would
    deliver nothing until the stream grew past it, skipping what came meanwhile."""
    return max(delivered_seq, ack_floor_seq) > stream_last_seq
