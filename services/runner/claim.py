"""A pulled task stays unacknowledged until the log says which runner has it.

A runner pulls a task, and says it has it with ``TaskStarted`` only once its first chunk is
out (sent earlier, that publish took CPU from the prompt's processing). Acked at the pull, a
task whose machine was lost in between would be known to no one: no surviving event names its
runner, so neither its worker nor a planner could continue it. So the task's message is acked
only once its ``TaskStarted`` is stored (or the task ended without one), and is kept in
progress meanwhile (``Claim``). If the runner is lost first, JetStream delivers the task again
after the consumer's ack wait, and the runner that gets it decides from the log
(``redelivered``) whether it is still to be served.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Literal

import nats.errors

from bus.consumer import Delivered

# The task consumer's ack wait, and how often a task not yet claimed says it is in progress.
ACK_WAIT_S = 15.0
IN_PROGRESS_S = 5.0


class Claim:
    """Keeps a delivered task in progress until ``done``, which acks it (once)."""

    def __init__(self, delivered: Delivered, every_s: float = IN_PROGRESS_S) -> None:
        self._delivered = delivered
        self._acked = False
        self._keeping = asyncio.ensure_future(self._keep(every_s))

    async def _keep(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(nats.errors.Error):  # a reconnect: the next one may pass
                await self._delivered.msg.in_progress()

    async def done(self) -> None:
        if self._acked:
            return
        self._acked = True
        self._keeping.cancel()
        await self._delivered.ack()


@dataclass(frozen=True)
class Seen:
    """What the log holds of a task delivered again (stream sequences; 0: none)."""

    this: int  # the delivered message
    latest_request: int  # the task's latest request (a continuation supersedes its original)
    started: int  # its latest TaskStarted
    ended: bool  # completed, failed or cancelled


Redelivery = Literal["superseded", "ended", "started", "lost"]


def redelivered(seen: Seen) -> Redelivery:
    """Why a task came again. ``superseded``: a continuation of it was published since (its
    runner's worker continued it). ``ended``: nothing is left to do. ``started``: a runner
    took it and only its ack was lost (a consumer's leader lost in a cluster); if that runner
    is gone too, its worker or a planner continues the task. ``lost``: the runner that pulled
    it was lost before it said so; the task goes on from the log."""
    if seen.latest_request != seen.this:
        return "superseded"
    if seen.ended:
        return "ended"
    if seen.started > seen.this:
        return "started"
    return "lost"
