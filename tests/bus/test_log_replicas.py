"""What a replicated log tolerates, as each machine says it (``bus/log_replicas.py``)."""

from __future__ import annotations

from bus.log_replicas import tolerance


def test_what_three_replicas_tolerate() -> None:
    assert tolerance(3, 3) == "the log is on 3 servers, 3 up: it survives the loss of 1 more"
    assert tolerance(3, 2) == "the log is on 3 servers, 2 up: one more loss stops it (no quorum)"
    assert tolerance(3, 1) == (
        "the log is on 3 servers, 1 up: no quorum, nothing can be stored until 1 more come back"
    )
    assert tolerance(5, 5).endswith("survives the loss of 2 more")
