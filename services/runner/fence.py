"""Whether a runner still holds the newest attempt of the task it serves (``events/attempts.py``).

A runner stalled past the task consumer's ack wait (SIGSTOP, swap, a paused VM) has its task
continued elsewhere, and when it wakes its generation goes on where it was. Before each group of
chunks it publishes, it makes sure that no newer attempt of its task exists, and once one does
it stops: its generation is cancelled, and it publishes nothing more, not even an outcome.

- It listens on the task's ``TaskCreated`` subject: a continuation published while it runs is
  heard at once, confirmed in the log, and its generation is cancelled then.
- It reads the task's last ``TaskCreated`` from the log before its first group (a stall may
  have come anywhere before it, even before it read the task), and again before a group
  whenever its last read is older than ``RECHECK_S``. No task is continued without seconds of
  silence (2 s without chunks for a planner, the 15 s ack wait for a task pulled but not
  started), so a runner stalled long enough to be continued reads the log before it publishes
  again; a runner that runs reads it once a second, not once a group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from bus.leaderless import RETRY_FOR_S, ask_again
from bus.streams import EVENTS_STREAM
from events.attempts import Attempt, attempt_of, superseded
from events.catalogue import TaskCreated, parse_event

log = logging.getLogger(__name__)

# A group of chunks is published without reading the log when the last read is this recent.
RECHECK_S = 1.0
# How long a continuation heard of is looked for in the log, and the pause between reads.
CONFIRM_WITHIN_S = 2.0
CONFIRM_PAUSE_S = 0.05


class Superseded(Exception):
    """The attempt a runner serves was continued elsewhere: it stops, publishing nothing."""


class Fence:
    """One task's fence, for the runner serving ``task`` (its attempt is the task's)."""

    def __init__(
        self,
        nc: Client,
        task: TaskCreated,
        on_superseded: Callable[[], None] = lambda: None,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._subject = TaskCreated.subject_for(task.model_id, task.task_id)
        self._task_id = task.task_id
        self.attempt = attempt_of(task).number
        self._on_superseded = on_superseded
        self._recheck_s = recheck_s
        self._read_at: float | None = None  # time.monotonic() when the last read was sent
        self._heard = False  # a newer attempt was heard of: read the log before the next group
        # Read by the engine's thread too (its cancel check): set once, never cleared.
        self.superseded = False
        self._sub: Subscription | None = None
        self.reads = 0  # log reads made (for tests and measurements)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subject, cb=self._on_created)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def holds(self) -> bool:
        """Whether this runner may publish its next group: no newer attempt of its task is
        known. Reads the log when due (see the module's doc); once False, always False."""
        if self.superseded:
            return False
        now = time.monotonic()
        if not self._heard and self._read_at is not None and now - self._read_at < self._recheck_s:
            return True
        self._heard = False
        latest = await self._latest()
        self._read_at = now
        if superseded(self.attempt, latest):
            if not self.superseded:
                self.superseded = True
                log.warning(
                    "task %s: attempt %d was continued elsewhere (attempt %s): this runner stops",
                    self._task_id,
                    self.attempt,
                    latest.number if latest is not None else "?",
                )
                self._on_superseded()
            return False
        return True

    async def _on_created(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if not (isinstance(event, TaskCreated) and superseded(self.attempt, attempt_of(event))):
            return
        # Heard on a plain subscription: confirmed in the log before the runner stops. A
        # subscriber can hear a message before the stream has stored it, so the log is read
        # again for a while; a continuation never stored (its publish failed) stops nothing.
        give_up_at = time.monotonic() + CONFIRM_WITHIN_S
        while True:
            self._heard = True
            if not await self.holds() or time.monotonic() >= give_up_at:
                return
            await asyncio.sleep(CONFIRM_PAUSE_S)

    async def _latest(self) -> Attempt | None:
        """The newest attempt of the task in the log (None: its TaskCreated is not there any
        more: the stream's retention dropped it)."""
        try:
            stored = await ask_again(
                lambda: self._js.get_last_msg(EVENTS_STREAM, self._subject),
                within_s=RETRY_FOR_S,
                pause_s=0.05,
                max_pause_s=1.0,
                what=f"reading {self._subject}",
            )
        except NotFoundError:
            return None
        finally:
            self.reads += 1
        event = parse_event(stored.data or b"")
        return attempt_of(event) if isinstance(event, TaskCreated) else None
