"""Admission control: how many of a model's tasks this API process lets run at once, who waits
for a slot, and who is refused.

Per model, at most ``capacity`` tasks this process published are in flight (published, not yet
finished, failed, cancelled or abandoned): the slots of the model's serving head runners
(``projection.serving_slots``). A request beyond it waits here, in the model's queue of at most
``max_queued`` requests (``shoal api --max-queued``; default ``QUEUE_PER_SLOT`` x capacity); one
that finds the queue full is refused at once with a 429 and a ``Retry-After``. A request holds
its place for all its tasks (``n`` choices are admitted together, counted ``n``).

When slots free, the queued requests are released in this order: the API key (``group``) with
queued requests and the fewest tasks in flight first, ties to the key served longest ago (so
between keys with as much running, round-robin); FIFO within a key. A key cannot keep every
slot while others wait: each slot that frees goes to the one that has least.

``Scheduler`` is the whole policy, pure (no I/O, the time passed in); ``Admission`` is the
waiting around it. With several API processes each keeps its own queue: together they may
publish more than the capacity, and JetStream queues what they over-admit, as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from pydantic import BaseModel
from starlette.types import Receive

from api.errors import QUEUE_FULL, ApiError

# The default queue bound, per slot: a request that finds the queue full would wait about this
# many tasks' durations. (One per slot made the third concurrent request to a one-slot model
# a 429: too tight for agents and benchmarks that send a handful at once.)
QUEUE_PER_SLOT = 16
# Weight of the latest task in the mean task duration (Retry-After's estimate).
EWMA = 0.2
RETRY_AFTER_MAX_S = 60


@dataclass(eq=False)  # by identity: a ticket is a dict key while it waits
class Ticket:
    """One request's place for its ``tasks`` tasks."""

    model: str
    group: str
    tasks: int
    arrived: float
    seq: int
    admitted_at: float | None = None
    done: int = 0  # tasks that ended (each frees its slot)

    @property
    def waited_s(self) -> float:
        return 0.0 if self.admitted_at is None else self.admitted_at - self.arrived


@dataclass(frozen=True)
class Refusal:
    """A request that found the model's queue full."""

    model: str
    capacity: int
    queued: int
    max_queued: int
    retry_after_s: int


class ModelAdmission(BaseModel):
    """One model's admission in one API process (``GET /v1/admission``, ``shoal state``)."""

    model: str
    capacity: int  # tasks this process lets be in flight: the serving runners' slots
    in_flight: int
    queued: int  # requests waiting in this process
    max_queued: int
    keys_waiting: int  # API keys with queued requests
    oldest_wait_s: float  # of the request queued longest, 0 when none is
    admitted: int  # requests admitted since this process started
    rejected: int  # requests refused with a 429
    mean_wait_s: float  # of the admitted requests, from arriving to being admitted
    mean_task_s: float | None  # recent tasks' time from admission to their end


class AdmissionState(BaseModel):
    origin: str  # the API process
    models: list[ModelAdmission]


@dataclass
class _Model:
    capacity: int = 1
    in_flight: int = 0
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)  # per group, FIFO
    queued: int = 0
    running: dict[str, int] = field(default_factory=dict)  # tasks in flight per group
    served: dict[str, int] = field(default_factory=dict)  # group -> turn of its last admission
    admitted: int = 0
    rejected: int = 0
    waited_s: float = 0.0
    mean_task_s: float | None = None


def retry_after_s(mean_task_s: float | None, capacity: int) -> int:
    """When to try again after a 429: a place in the queue frees each time a slot does, about
    every mean task duration / capacity; whole seconds, 1 to ``RETRY_AFTER_MAX_S``."""
    if mean_task_s is None:
        return 1
    return max(1, min(RETRY_AFTER_MAX_S, math.ceil(mean_task_s / max(capacity, 1))))


class Scheduler:
    """The admission policy of one API process (see the module's docstring); every method
    that can free a place returns the queued tickets it admitted, in order."""

    def __init__(self, max_queued: int | None = None) -> None:
        self.max_queued = max_queued  # None: QUEUE_PER_SLOT x capacity
        self._models: dict[str, _Model] = {}
        self._seq = 0
        self._turn = 0

    def _model(self, model: str) -> _Model:
        return self._models.setdefault(model, _Model())

    def limit(self, model: str) -> int:
        """How many requests may wait for ``model``."""
        if self.max_queued is not None:
            return self.max_queued
        return QUEUE_PER_SLOT * self._model(model).capacity

    def resize(self, model: str, capacity: int, now: float) -> list[Ticket]:
        """The model's capacity as last read (at least 1: it was found able to serve)."""
        m = self._model(model)
        m.capacity = max(1, capacity)
        return self._release(m, now)

    def arrive(
        self, model: str, group: str, tasks: int, now: float, bounded: bool = True
    ) -> Ticket | Refusal:
        """A request for ``tasks`` tasks: admitted (``admitted_at`` set), queued, or refused
        (a ``Refusal``). Unbounded: queued whatever the bound (accepted earlier)."""
        m = self._model(model)
        self._seq += 1
        ticket = Ticket(model, group, max(1, tasks), now, self._seq)
        if m.queued == 0 and _fits(m, ticket):
            self._admit(m, ticket, now)
            return ticket
        refused = self.refusal(model, tasks) if bounded else None
        if refused is not None:
            m.rejected += 1
            return refused
        m.queues.setdefault(group, deque()).append(ticket)
        m.queued += 1
        return ticket

    def refusal(self, model: str, tasks: int = 1) -> Refusal | None:
        """Why a request of ``tasks`` tasks arriving now would be refused (None: it would be
        admitted or queued)."""
        m = self._model(model)
        limit = self.limit(model)
        if m.queued < limit or (m.queued == 0 and _room(m, tasks)):
            return None
        return Refusal(model, m.capacity, m.queued, limit, retry_after_s(m.mean_task_s, m.capacity))

    def finish(self, ticket: Ticket, now: float, timed: bool = True) -> list[Ticket]:
        """One of an admitted ticket's tasks ended (``timed``: it ran, and its time counts
        in the mean task duration; not one that was never published)."""
        if ticket.admitted_at is None or ticket.done >= ticket.tasks:
            return []
        m = self._model(ticket.model)
        ticket.done += 1
        m.in_flight -= 1
        left = m.running.get(ticket.group, 0) - 1
        if left > 0:
            m.running[ticket.group] = left
        else:
            m.running.pop(ticket.group, None)
            self._forget_if_idle(m, ticket.group)
        if timed:
            took = max(0.0, now - ticket.admitted_at)
            last = m.mean_task_s
            m.mean_task_s = took if last is None else last + EWMA * (took - last)
        return self._release(m, now)

    def leave(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A queued ticket's client went away: it leaves the queue."""
        m = self._model(ticket.model)
        queue = m.queues.get(ticket.group)
        if ticket.admitted_at is not None or queue is None or ticket not in queue:
            return []
        queue.remove(ticket)
        m.queued -= 1
        if not queue:
            del m.queues[ticket.group]
            self._forget_if_idle(m, ticket.group)
        return self._release(m, now)  # it may have been the one that did not fit

    def snapshot(self, now: float) -> list[ModelAdmission]:
        out = []
        for name in sorted(self._models):
            m = self._models[name]
            oldest = min((q[0].arrived for q in m.queues.values()), default=now)
            out.append(
                ModelAdmission(
                    model=name,
                    capacity=m.capacity,
                    in_flight=m.in_flight,
                    queued=m.queued,
                    max_queued=self.limit(name),
                    keys_waiting=len(m.queues),
                    oldest_wait_s=round(now - oldest, 3),
                    admitted=m.admitted,
                    rejected=m.rejected,
                    mean_wait_s=round(m.waited_s / m.admitted, 3) if m.admitted else 0.0,
                    mean_task_s=None if m.mean_task_s is None else round(m.mean_task_s, 3),
                )
            )
        return out

    def _admit(self, m: _Model, ticket: Ticket, now: float) -> None:
        ticket.admitted_at = now
        m.in_flight += ticket.tasks
        m.running[ticket.group] = m.running.get(ticket.group, 0) + ticket.tasks
        self._turn += 1
        m.served[ticket.group] = self._turn
        m.admitted += 1
        m.waited_s += now - ticket.arrived

    def _release(self, m: _Model, now: float) -> list[Ticket]:
        released: list[Ticket] = []
        while m.queues:
            group = min(
                m.queues,
                key=lambda g: (m.running.get(g, 0), m.served.get(g, 0), m.queues[g][0].seq),
            )
            queue = m.queues[group]
            if not _fits(m, queue[0]):
                break  # the next in turn waits for room; nobody overtakes it
            ticket = queue.popleft()
            m.queued -= 1
            if not queue:
                del m.queues[group]
            self._admit(m, ticket, now)
            released.append(ticket)
        return released

    @staticmethod
    def _forget_if_idle(m: _Model, group: str) -> None:
        # A key with nothing running or queued leaves the rotation (the dicts stay small with
        # many keys); when it comes back it is as one never served.
        if group not in m.running and group not in m.queues:
            m.served.pop(group, None)


def _fits(m: _Model, ticket: Ticket) -> bool:
    return _room(m, ticket.tasks)


def _room(m: _Model, tasks: int) -> bool:
    # A request of more tasks than the capacity runs alone rather than never.
    return m.in_flight == 0 or m.in_flight + tasks <= m.capacity


# --- who asks, and the waiting --------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who sent the request being served: its key's group, and (for a request that waits)
    how to hear that its client went away."""

    group: str = ""
    receive: Receive | None = None
    # Accepted already (a background response): it waits whatever the bound, unwatched.
    background: bool = False


# Set where the key is read (context.require_key): the serving path is shared by
# every dialect's routes, which do not pass the request on.
NOBODY = Caller()  # no key, nothing to watch (tests calling serve directly)
CALLER: ContextVar[Caller] = ContextVar("shoal_caller", default=NOBODY)


def group_of(key: str) -> str:
    """The fairness group of a request's key: a digest, so that the key is never kept (nor
    shown, nor logged); '' for requests without one."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


def note_caller(key: str, receive: Receive | None) -> None:
    CALLER.set(Caller(group_of(key), receive))


def in_background() -> None:
    """The current task serves a request whose client has its answer already."""
    CALLER.set(Caller(CALLER.get().group, None, background=True))


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Permit:
    """An admitted request's slots: each of its tasks frees one when it ends (``task_done``);
    ``close`` frees those left (tasks never published)."""

    def __init__(self, admission: Admission, ticket: Ticket) -> None:
        self._admission = admission
        self.ticket = ticket

    def task_done(self) -> None:
        self._admission.finish(self.ticket)

    def close(self) -> None:
        for _ in range(self.ticket.tasks - self.ticket.done):
            self._admission.finish(self.ticket, timed=False)


class Admission:
    """The scheduler of one API process, with the requests waiting on it."""

    def __init__(
        self, max_queued: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.scheduler = Scheduler(max_queued)
        self._clock = clock
        self._waiting: dict[Ticket, asyncio.Future[None]] = {}

    def snapshot(self) -> list[ModelAdmission]:
        return self.scheduler.snapshot(self._clock())

    def refusal(self, model: str, tasks: int, capacity: int) -> ApiError | None:
        """The 429 a request for ``model`` would get now, if any (a background response is
        refused before it is answered)."""
        self._wake(self.scheduler.resize(model, capacity, self._clock()))
        refused = self.scheduler.refusal(model, tasks)
        return None if refused is None else queue_full(refused)

    async def enter(
        self, model: str, tasks: int, capacity: int, caller: Caller, timeout_s: float
    ) -> Permit:
        """Admit a request of ``tasks`` tasks, waiting for room if it must: the 429 of a full
        queue, the 504 of a wait past ``timeout_s``, the 499 of a client that went away while
        queued (nobody reads it, but the metrics count it)."""
        now = self._clock()
        self._wake(self.scheduler.resize(model, capacity, now))
        got = self.scheduler.arrive(model, caller.group, tasks, now, not caller.background)
        if isinstance(got, Refusal):
            raise queue_full(got)
        if got.admitted_at is None:
            await self._wait(got, None if caller.background else caller.receive, timeout_s)
        return Permit(self, got)

    def finish(self, ticket: Ticket, timed: bool = True) -> None:
        self._wake(self.scheduler.finish(ticket, self._clock(), timed))

    async def _wait(self, ticket: Ticket, receive: Receive | None, timeout_s: float) -> None:
        admitted = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = admitted
        watcher = asyncio.ensure_future(_disconnected(receive)) if receive else None
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait(
                    [admitted, *([watcher] if watcher else [])], return_when=asyncio.FIRST_COMPLETED
                )
            if not admitted.done():
                raise ApiError(
                    499, "the client went away while the request was queued", code="client_gone"
                )
        except BaseException as exc:
            self._waiting.pop(ticket, None)
            if ticket.admitted_at is not None:  # admitted as it gave up: free its slots
                Permit(self, ticket).close()
            else:
                self._wake(self.scheduler.leave(ticket, self._clock()))
            if isinstance(exc, TimeoutError):
                raise ApiError(
                    504,
                    f"the request waited {timeout_s:.0f} s for one of model"
                    f" `{ticket.model}`'s slots, as long as the API waits",
                    code="queue_timeout",
                ) from None
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
                if watcher.done() and not watcher.cancelled():
                    watcher.exception()  # retrieved: a receive that failed is a client gone

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            admitted = self._waiting.pop(ticket, None)
            if admitted is not None and not admitted.done():
                admitted.set_result(None)


def queue_full(refusal: Refusal) -> ApiError:
    """The 429 of a full queue: OpenAI's ``rate_limit_exceeded`` (Anthropic's dialect makes it
    an ``overloaded_error``), with ``Retry-After``."""
    after = refusal.retry_after_s
    return ApiError(
        429,
        f"model `{refusal.model}` is busy: its {refusal.capacity} slot(s) are taken and"
        f" {refusal.queued} request(s) are waiting, as many as this API queues"
        f" ({refusal.max_queued}); try again in {after} s",
        code=QUEUE_FULL,
        headers={"Retry-After": str(after)},
    )
