"""One image task, from the API's side: publish its ``TaskCreated`` (kind ``image``), then
follow its chunk subject (``ImageStepped``, ``ImageGenerated``) and its outcome, reading each
image's PNG back from where the runner stored it (``bus/stores/images.py``).

As for an embeddings task (``embedding_task.py``): subscriptions before the publish, the model
checked every ``RECHECK_S`` while nothing comes, the log asked after a quiet spell (what a
subscription misses while NATS reconnects), and ``TaskCancelled`` when the API stops waiting
without an outcome (the client went away). A task continued after its runner was lost is
generated again from step 0: the images of its newest attempt are the ones kept (an older
attempt's, identical for the same seed, are dropped)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from api.context import ApiContext
from api.embedding_task import RequestLost, Unavailable
from api.errors import ApiError
from api.serving import (
    failure_error,
    gate,
    log_unavailable,
    owned,
    recheck,
    request_lost,
    unavailable,
    used,
)
from api.task_stream import (
    RECHECK_S,
    outcome_subject,
    publish_in_background,
    request_gone,
    stored_outcome,
)
from bus.reader import read_stream
from bus.stores.images import image_bytes
from bus.stores.parts import PartMissing, PartStore
from bus.streams import CHUNKS_STREAM
from events.catalogue import (
    ImageGenerated,
    ImageStepped,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    parse_event,
)
from events.records import ImagePart

Outcome = TaskCompleted | TaskFailed
Followed = ImageStepped | ImageGenerated | Outcome


@dataclass(frozen=True)
class Made:
    """An image of the task (``partial`` None: finished), its PNG read back."""

    index: int
    partial: int | None
    png: bytes
    seed: int | None
    image: ImagePart | None = None  # where its bytes are stored
    steps: int = 0  # the denoising steps it took (so far, for a partial one)


async def generated(ctx: ApiContext, task: TaskCreated) -> AsyncIterator[Made | TaskCompleted]:
    """The task's images as they come (partial ones where asked, then each finished one), and
    last its completion; through the gate every inference request passes (the key's limits,
    the model serving, a slot), owned by the request's key, its steps counted for it. A refusal
    or failure raises ``ApiError``."""
    task = owned(task)
    permit = await gate(ctx, task.model_id, keep_alive_s=task.keep_alive_s)
    try:
        follower = ImageTask(ctx, task)
        async for item in follower.run():
            if isinstance(item, TaskCompleted):
                permit.task_done()
                used(ctx, item.usage.total_tokens)
            yield item
    except nats.errors.Error as exc:
        raise log_unavailable(exc) from exc
    except Unavailable as exc:
        raise unavailable(str(exc)) from None
    except RequestLost:
        raise request_lost() from None
    except TimeoutError:
        raise ApiError(504, "the task took longer than the API waits") from None
    finally:
        permit.close()


class ImageTask:
    def __init__(self, ctx: ApiContext, task: TaskCreated) -> None:
        self._ctx = ctx
        self.task = task
        self._recheck = recheck(ctx, task.model_id)
        self._queue: asyncio.Queue[Followed] = asyncio.Queue()
        self._parts = PartStore(ctx.nc.jetstream())
        self._attempt = 0  # the newest attempt seen
        self._sent: set[tuple[int, int, int | None]] = set()  # (attempt, index, partial)
        self._outcome: Outcome | None = None
        self._moving = False  # a step or an image came
        self._steps: dict[tuple[int, int], int] = {}  # (attempt, image): its last step

    async def run(self) -> AsyncIterator[Made | TaskCompleted]:
        nc, t = self._ctx.nc, self.task
        subs: list[Subscription] = []
        published = False
        try:
            chunks = ImageStepped.subject_for(t.task_id)
            outcomes = (outcome_subject(t, TaskCompleted), outcome_subject(t, TaskFailed))
            for subject in (chunks, *outcomes):
                subs.append(await nc.subscribe(subject, cb=self._on_msg))
            await self._ctx.publish(t)
            published = True
            async with asyncio.timeout(self._ctx.config.task_timeout_s):
                async for item in self._follow():
                    yield item
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            if published and self._outcome is None:
                self._cancel()

    async def _follow(self) -> AsyncIterator[Made | TaskCompleted]:
        while True:
            try:
                async with asyncio.timeout(RECHECK_S):
                    event = await self._queue.get()
            except TimeoutError:
                if not self._moving and (why := await self._recheck()) is not None:
                    raise Unavailable(why) from None
                await self._catch_up()
                continue
            if isinstance(event, TaskFailed):
                if (event.attempt or 0) >= self._attempt:
                    self._outcome = event
                    raise failure_error(event)
                continue
            if isinstance(event, TaskCompleted):
                if (event.attempt or 0) >= self._attempt:
                    self._outcome = event
                    yield event
                    return
                continue
            self._moving = True
            attempt = event.attempt or 0
            if attempt < self._attempt:
                continue  # an attempt continued since: the newest one's images are kept
            self._attempt = attempt
            if isinstance(event, ImageStepped):
                self._steps[(attempt, event.image)] = event.step
            if isinstance(event, ImageGenerated):
                key = (attempt, event.index, event.partial)
                if key in self._sent:
                    continue
                self._sent.add(key)
                if any((a, event.index, None) in self._sent for a in range(attempt)):
                    continue  # this image was given already, by an attempt before
                png = await self._png(event)
                steps = self._steps.get((attempt, event.index), 0)
                yield Made(event.index, event.partial, png, event.seed, event.png, steps)

    async def _png(self, event: ImageGenerated) -> bytes:
        try:
            return await image_bytes(self._parts, event.png)
        except PartMissing as exc:
            raise ApiError(500, f"the runner's image cannot be read: {exc}") from exc

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if isinstance(event, ImageStepped | ImageGenerated | TaskCompleted | TaskFailed):
            self._queue.put_nowait(event)

    async def _catch_up(self) -> None:
        """Queue the outcome, and the stored images, if the log has the outcome."""
        outcome, _ = await stored_outcome(self._ctx.nc, self.task)
        if outcome is None:
            if await request_gone(self._ctx.nc, self.task):
                raise RequestLost()
            return
        js = self._ctx.nc.jetstream()
        subject = ImageGenerated.subject_for(self.task.task_id)
        async for m in read_stream(js, CHUNKS_STREAM, subject):
            with contextlib.suppress(ValidationError):
                if isinstance(event := parse_event(m.data), ImageGenerated):
                    self._queue.put_nowait(event)
        self._queue.put_nowait(outcome)

    def _cancel(self) -> None:
        t = self.task
        cancel = TaskCancelled(
            task_id=t.task_id,
            model_id=t.model_id,
            origin=self._ctx.origin,
            reason="no longer awaited",
        )
        publish_in_background(self._ctx.publish, cancel)
