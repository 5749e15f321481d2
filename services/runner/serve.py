"""Serving tasks: pull TaskCreated, generate, publish chunks and the outcome.

The replicas of a model share one durable pull consumer (``tasks-<model>``), and each pulls one
task only when it is free, so a task goes to one runner and an idle runner takes the next one.
An embed instance's runners pull ``EmbeddingsRequested`` through a consumer of their own
(``embeddings-<model>``, ``embed_serve.py``), so that chat and embed runners of one model
never take each other's tasks.
A task is acked once its TaskStarted is stored (``claim.py``): a runner lost before that leaves
it to be delivered again. A runner that dies mid-generation has its tasks continued
(``services/resume.py``, by its worker or a planner): each comes again as a ``TaskCreated``
with ``resume``, and the runner that takes it goes on after the tokens already published, at
the next chunk index. Each run of a task is an attempt (0, then each continuation's
``resume.attempt``): its chunks and outcome say which, and a runner that was only stalled while
its task was continued stops before it publishes again (``fence.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from bus.consumer import PULL_WAIT_S, Delivered, EventConsumer
from bus.publisher import ChunkPublisher, Publisher
from bus.puller import ConsumerGone
from bus.stores.claim_check import resolved
from bus.stores.parts import PartMissing, PartStore
from bus.streams import EVENTS_STREAM
from events.attempts import attempt_of, outcome_msg_id
from events.catalogue import (
    EventBase,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
    utc_now,
)
from inference.engines.base import Engine, EngineBroken
from inference.feed_sink import Generating
from inference.generation import PromptTooLong, check_request
from inference.job import prepared
from services.resume import continuation, describe, message_id, read_logged
from services.runner.attempt import AttemptPublisher
from services.runner.claim import ACK_WAIT_S, Claim, Seen, redelivered
from services.runner.consumers import Pulled, cancel_subject, tasks_consumer_name
from services.runner.current_tasks import CurrentTasks
from services.runner.fence import Fence, Superseded
from services.runner.images import images_for
from services.runner.state_reporter import RunnerIdentity, StateReporter
from structured.reply import InvalidRequest

log = logging.getLogger(__name__)


def _reap(serving: set[asyncio.Task[None]]) -> None:
    """Forget the tasks served; raise the error of one that ended with one (a task's own
    errors are reported as its failure: what comes here is an engine that cannot go on)."""
    for task in [t for t in serving if t.done()]:
        serving.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc


async def _first_done(serving: set[asyncio.Task[None]], stop: asyncio.Event) -> None:
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({*serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()


# Chunks after the first are published in groups this far apart at most.
CHUNK_WINDOW_S = 0.05


class TaskPuller(ABC):
    """Pulls a model's requests of one kind from its shared consumer and serves each
    (``serve_pulled``), up to ``slots`` at once: a new one is pulled only while a slot is free
    (so an idle replica takes the next one, and a busy one leaves it). What a chat and an embed
    runner have in common."""

    def __init__(
        self, nc: Client, me: RunnerIdentity, task_file: Path | None = None, slots: int = 1
    ) -> None:
        self._nc = nc
        self.slots = slots
        self._current = CurrentTasks(task_file)
        self._js = nc.jetstream()
        self._me = me
        self._events = Publisher(self._js)
        self._chunks = ChunkPublisher(self._js)
        self._parts = PartStore(self._js)
        self._state = StateReporter(nc, me)
        self._consumer: EventConsumer | None = None
        # A pooling runner's requests are computed here, off the event loop (a chat runner's
        # engine generates on a thread of its own); one thread per slot.
        self._engine_thread = ThreadPoolExecutor(slots, thread_name_prefix="engine")
        self.served = 0
        self._busy = 0  # tasks being served
        self._reported_running = False

    @abstractmethod
    def consumer_names(self) -> tuple[str, str]:
        """The durable consumer and its filter."""

    @abstractmethod
    async def serve_pulled(self, task: Pulled, claim: Claim) -> bool:
        """Serve one request pulled (of the kind this puller serves); whether it was (not: a
        request of another kind, or cancelled before it started). ``claim.done()`` once its
        TaskStarted is stored (else it is acked when this returns)."""

    async def start(self) -> None:
        """Bind to the model's task consumer. Done before the runner reports Ready, so that a
        task published once it is Ready cannot be missed."""
        durable, filter_subject = self.consumer_names()
        self._consumer = EventConsumer(
            self._js,
            EVENTS_STREAM,
            durable=durable,
            filter_subject=filter_subject,
            # Tasks from before any runner of the model existed were answered 503 by the API.
            deliver_policy=DeliverPolicy.NEW,
            ack_wait=ACK_WAIT_S,
        )
        await self._consumer.start()

    async def serve_forever(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``; the tasks in flight then finish. A task's error that the
        engine cannot go past (``EngineBroken``) ends it, once the others finished."""
        if self._consumer is None:
            await self.start()
        assert self._consumer is not None
        serving: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                _reap(serving)
                if len(serving) >= self.slots:
                    await _first_done(serving, stop)
                    continue
                try:
                    delivered = await self._consumer.fetch(1, timeout=PULL_WAIT_S, stop=stop)
                except ConsumerGone:  # deleted by hand: made again, for the tasks from now on
                    log.warning(
                        "the task consumer %s is gone: making it again", self._consumer.durable
                    )
                    await self._remake_consumer(stop)
                    continue
                for d in delivered:
                    if isinstance(d.event, Pulled) and not await self._left(d):
                        serving.add(asyncio.create_task(self._serve_one(d)))
                    else:
                        await d.ack()
        finally:
            if serving:
                await asyncio.wait(serving)
            await self._consumer.stop()
        _reap(serving)

    async def _serve_one(self, d: Delivered) -> None:
        assert isinstance(d.event, Pulled)
        task, claim = d.event, Claim(d)
        self._busy += 1
        self._current.begin(task)
        try:
            if await self.serve_pulled(task, claim):
                self.served += 1
        finally:
            await claim.done()
            self._current.end(task)
            self._busy -= 1
            if self._busy == 0 and self._reported_running:
                self._reported_running = False
                await self._state.report("Ready")

    async def report_running(self) -> None:
        """Running, once a task of an idle runner started (Ready again when none is left)."""
        if not self._reported_running:
            self._reported_running = True
            await self._state.report("Running")

    async def _left(self, d: Delivered) -> bool:
        """Whether a task JetStream delivered again is not to be served (claim.py). Only
        redeliveries pay for the look. One whose runner was lost before it said so goes on
        from the log: its continuation is published, and served as any task."""
        task = d.event
        assert isinstance(task, Pulled)
        if d.msg.metadata.num_delivered <= 1:
            return False
        seen = Seen(
            this=d.stream_seq,
            latest_request=await self._last_seq(task, type(task)),
            started=await self._last_seq(task, TaskStarted),
            ended=await self._logged(task, TaskCompleted, TaskFailed, TaskCancelled),
        )
        why = redelivered(seen)
        if why != "lost":
            log.warning("task %s came again, but it was %s: not served twice", task.task_id, why)
            return True
        if not isinstance(task, TaskCreated):
            return False  # an embeddings request has nothing to go on from: served again
        logged = await read_logged(self._js, task.task_id, task.model_id)
        outcome = continuation(
            logged,
            runner_id="",
            origin=self._me.node_id,
            at=utc_now(),
            cause="was lost before it started it",
        )
        await self._events.publish(outcome, msg_id=message_id(outcome))
        log.info("task %s came again (its runner was lost): %s", task.task_id, describe(outcome))
        return True

    async def _remake_consumer(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        await self._consumer.stop()
        while not stop.is_set():
            try:
                await self.start()
                return
            except (nats.errors.Error, TimeoutError) as exc:  # the log is not back yet
                log.warning("the task consumer could not be made yet: %r", exc)
                await asyncio.sleep(1.0)

    async def _logged(self, task: Pulled, *kinds: type[EventBase]) -> bool:
        """Whether the log holds an event of one of these kinds for ``task``."""
        return any([await self._last_seq(task, kind) > 0 for kind in kinds])

    async def _last_seq(self, task: Pulled, kind: type[EventBase]) -> int:
        """The stream sequence of ``task``'s latest event of this kind; 0 if it has none."""
        subject = kind.subject_for(task.model_id, task.task_id)
        try:
            return (await self._js.get_last_msg(EVENTS_STREAM, subject)).seq or 0
        except NotFoundError:
            return 0

    async def _fail(self, task: Pulled, error: str, too_long: PromptTooLong | None = None) -> None:
        failed = self._failure(task, error, too_long)
        await self._events.publish(failed, msg_id=outcome_msg_id(task.task_id, failed.attempt))

    def _failure(self, task: Pulled, error: str, too_long: PromptTooLong | None) -> TaskFailed:
        return TaskFailed(
            task_id=task.task_id,
            model_id=task.model_id,
            origin=self._me.node_id,
            runner_id=self._me.runner_id,
            error=error,
            attempt=attempt_of(task).number if isinstance(task, TaskCreated) else None,
            prompt_tokens=too_long.prompt_tokens if too_long else None,
            context_length=too_long.context_length if too_long else None,
        )


class TaskServer(TaskPuller):
    """A chat runner's: generation tasks (``TaskCreated``)."""

    def __init__(
        self, nc: Client, engine: Engine, me: RunnerIdentity, task_file: Path | None = None
    ) -> None:
        super().__init__(nc, me, task_file, slots=engine.slots)
        self._engine = engine

    def consumer_names(self) -> tuple[str, str]:
        model = self._me.model_id
        return tasks_consumer_name(model), TaskCreated.filter_for(model)

    async def serve_pulled(self, task: Pulled, claim: Claim) -> bool:
        if not isinstance(task, TaskCreated):
            return False
        await self.serve(task, claim)
        return True

    async def serve(self, task: TaskCreated, claim: Claim) -> None:
        received = time.perf_counter()
        cancelled = asyncio.Event()

        async def on_cancel(_msg: Msg) -> None:
            cancelled.set()

        sub = await self._nc.subscribe(cancel_subject(task), cb=on_cancel)
        fence = Fence(self._nc, task)  # a newer attempt of the task stops this one
        await fence.start()
        out = AttemptPublisher(
            fence,
            self._events,
            self._chunks,
            task,
            self._me,
            received,
            claim,
            self.report_running,
            after_first=lambda: self._was_cancelled(task, cancelled),
        )
        try:
            await self._generate(task, out, lambda: cancelled.is_set() or fence.superseded)
        except Superseded:
            out.abandon()  # another runner has the task: this attempt ends without an outcome
        except Exception as exc:
            if isinstance(exc, InvalidRequest):
                error = f"invalid request: {exc}"
            elif isinstance(exc, PartMissing):
                error = f"its prompt cannot be read from the log: {exc}"
            else:  # an engine error fails this task, not the runner...
                log.exception("task %s failed", task.task_id)
                error = f"engine error: {exc}"
            too_long = exc if isinstance(exc, PromptTooLong) else None
            await out.fail(self._failure(task, error, too_long))
            if isinstance(exc, EngineBroken):  # ...unless the engine cannot go on
                raise
        finally:
            out.close()
            await sub.unsubscribe()
            await fence.stop()

    async def _was_cancelled(self, task: TaskCreated, flag: asyncio.Event) -> None:
        """A cancel published before this runner subscribed is in the log; so is the failure of
        a task whose runner died before its ack got out (its worker failed it, and JetStream
        delivered it again)."""
        if await self._logged(task, TaskCancelled, TaskFailed):
            flag.set()

    async def _generate(
        self, task: TaskCreated, out: AttemptPublisher, cancelled: Callable[[], bool]
    ) -> None:
        """Generate, publish, complete; raises ``Superseded`` (having published no more) once
        a newer attempt of the task exists."""
        engine = self._engine
        task = await resolved(self._parts, task)  # its messages and tools, stored as parts
        images = await images_for(self._parts, engine, task)
        job = await prepared(engine, task, images)
        limit = check_request(len(job.prompt), task.params, engine.n_ctx, echo=task.echo)
        out.prompt_tokens = len(job.prompt)
        out.resumed(len(job.decoding.generated))
        generating = Generating(engine, job, limit, cancelled, CHUNK_WINDOW_S, out.cached)
        async with generating:
            async for made in generating:
                await out.publish(made)
        generating.outcome()
        await out.complete()
