"""Serving image tasks: an image model's runners pull its ``TaskCreated`` (kind ``image``)
through the model's task consumer, as chat runners do, and generate with the image engine
(``inference/image_generation.py``).

What goes out, on the task's chunk subject: ``ImageStepped`` after every denoising step (image
i of n, step j of m), and ``ImageGenerated`` for each partial and each finished image, naming
its PNG, whose bytes are stored by digest on ``SHOAL_PARTS`` first (``bus/stores/images.py``):
no event holds an image. Then ``TaskCompleted``, or ``TaskFailed``.

A cancel (``TaskCancelled``, heard on its subject or found in the log) stops the engine after
the step under way. A runner lost mid-generation has its task continued as a text task's is
(``services/resume.py``): the continuation names no tokens, and is generated again from step 0
with the same seeds (the same images); its events carry its attempt, and a runner whose attempt
was continued elsewhere publishes nothing more (``fence.py``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.stores.images import piece_bytes, stored_image
from events.attempts import outcome_msg_id
from events.catalogue import (
    ImageGenerated,
    ImageStepped,
    TaskCancelled,
    TaskCompleted,
    TaskCreated,
    TaskFailed,
    TaskStarted,
)
from events.records import ImageParams, Timings, Usage
from inference.image_generation import (
    GeneratedImage,
    GenerationCancelled,
    ImageEngine,
    Progress,
)
from services.runner.claim import Claim
from services.runner.consumers import Pulled, cancel_subject, tasks_consumer_name
from services.runner.fence import Fence, Superseded
from services.runner.serve import TaskPuller
from services.runner.spec import RunnerSpec
from services.runner.state_reporter import RunnerIdentity, StateReporter

log = logging.getLogger(__name__)

Made = Progress | GeneratedImage


class ImageServer(TaskPuller):
    """An image model's runner: its ``TaskCreated`` of kind ``image``, one at a time."""

    def __init__(
        self, nc: Client, engine: ImageEngine, me: RunnerIdentity, task_file: Path | None = None
    ) -> None:
        super().__init__(nc, me, task_file)
        self._engine = engine
        # How many partial images each image of a task in flight has had (task, attempt, image).
        self._partials: dict[tuple[str, int, int], int] = {}

    def consumer_names(self) -> tuple[str, str]:
        model = self._me.model_id
        return tasks_consumer_name(model), TaskCreated.filter_for(model)

    async def serve_pulled(self, task: Pulled, claim: Claim) -> bool:
        if not isinstance(task, TaskCreated):
            return False
        if task.kind != "image" or task.image is None:
            await self._fail(task, f"invalid request: model {task.model_id} makes images only")
            return True
        if await self._logged(task, TaskCancelled, TaskFailed):
            log.info("image task %s was cancelled before it started", task.task_id)
            return False
        await self.serve(task, task.image, claim)
        return True

    async def serve(self, task: TaskCreated, params: ImageParams, claim: Claim) -> None:
        received = time.perf_counter()
        refused = self._engine.refusal(params)
        if refused is not None:
            await self._fail(task, f"invalid request: {refused}")
            return
        cancelled = threading.Event()

        async def on_cancel(_msg: Msg) -> None:
            cancelled.set()

        sub = await self._nc.subscribe(cancel_subject(task), cb=on_cancel)
        fence = Fence(self._nc, task)
        await fence.start()
        try:
            await self._generate(task, params, claim, fence, cancelled, received)
        except Superseded:
            pass  # another runner has the task: this attempt ends without an outcome
        except Exception as exc:  # an engine error fails this task, not the runner
            log.exception("image task %s failed", task.task_id)
            if not fence.superseded:
                await self._fail(task, f"engine error: {exc}")
        finally:
            await sub.unsubscribe()
            await fence.stop()

    async def _generate(
        self,
        task: TaskCreated,
        params: ImageParams,
        claim: Claim,
        fence: Fence,
        cancelled: threading.Event,
        received: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        made: asyncio.Queue[Made | None] = asyncio.Queue()

        def put(item: Made | None) -> None:
            loop.call_soon_threadsafe(made.put_nowait, item)

        def stop_asked() -> bool:
            return cancelled.is_set() or fence.superseded

        generating = loop.run_in_executor(
            self._engine_thread, self._run, task.prompt or "", params, put, stop_asked
        )
        started = False
        steps = 0
        first_image: float | None = None
        try:
            while (item := await made.get()) is not None:
                if not await fence.holds():
                    cancelled.set()
                    break
                if not started:
                    started = True
                    await self._announce(task, claim)
                if isinstance(item, Progress):
                    steps += 1
                    await self._publish_step(task, fence.attempt, item)
                else:
                    first_image = first_image or time.perf_counter()
                    await self._publish_image(task, fence.attempt, item.index, None, item)
        finally:
            cancelled.set()  # (the engine has ended, or must now: never left running)
            await asyncio.wait({generating})
        if fence.superseded:
            raise Superseded(task.task_id)
        finish = "stop"
        try:
            generating.result()
        except GenerationCancelled:
            finish = "cancelled"
        await self._chunks.flush()
        if not started:  # cancelled before its first step: it still says it started
            await self._announce(task, claim)
        end = time.perf_counter()
        await self._events.publish(
            TaskCompleted(
                task_id=task.task_id,
                model_id=task.model_id,
                origin=self._me.node_id,
                runner_id=self._me.runner_id,
                finish_reason=finish,
                attempt=fence.attempt,
                # An image task's "tokens" are its denoising steps (usage counts them per key).
                usage=Usage(prompt_tokens=0, completion_tokens=steps),
                timings=Timings(
                    ttft_ms=((first_image or end) - received) * 1000,
                    tokens_per_s=steps / (end - received) if end > received else 0.0,
                    total_ms=(end - received) * 1000,
                ),
            ),
            msg_id=outcome_msg_id(task.task_id, fence.attempt),
        )

    def _run(
        self,
        prompt: str,
        params: ImageParams,
        put: Callable[[Made | None], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """On the engine's thread: each image in turn (so that each goes out when made), image
        i drawn with the task's seed + i, as one call for n would."""
        try:
            for i in range(params.n):
                one = params.model_copy(update={"n": 1, "seed": (params.seed or 0) + i})

                def on_step(p: Progress, i: int = i) -> None:
                    put(Progress(i, params.n, p.step, p.steps, p.partial))

                for image in self._engine.generate(prompt, one, on_step, cancelled):
                    put(GeneratedImage(i, image.png, image.width, image.height, image.seed))
        finally:
            put(None)

    async def _announce(self, task: TaskCreated, claim: Claim) -> None:
        started = TaskStarted(
            task_id=task.task_id,
            model_id=task.model_id,
            origin=self._me.node_id,
            runner_id=self._me.runner_id,
            instance_id=self._me.instance_id,
        )
        await asyncio.gather(self._events.publish(started), self.report_running())
        await claim.done()

    async def _publish_step(self, task: TaskCreated, attempt: int, p: Progress) -> None:
        step = ImageStepped(
            task_id=task.task_id,
            origin=self._me.node_id,
            image=p.image,
            images=p.images,
            step=p.step,
            steps=p.steps,
            attempt=attempt,
        )
        msg_id = f"step:{task.task_id}:{attempt}:{p.image}:{p.step}"
        await self._chunks.publish(step, msg_id=msg_id)
        if p.partial is not None:
            await self._publish_image(task, attempt, p.image, p.step, p.partial)

    async def _publish_image(
        self,
        task: TaskCreated,
        attempt: int,
        index: int,
        partial_step: int | None,
        image: GeneratedImage | bytes,
    ) -> None:
        """Store the PNG's bytes by digest, then publish the event that names them."""
        png = image.png if isinstance(image, GeneratedImage) else image
        width, height = _size(image, task)
        record, parts = stored_image(
            png, "image/png", width, height, piece_bytes(self._parts.limit)
        )
        await self._parts.store(parts)
        partial = None
        if partial_step is not None:
            partial = self._partials.setdefault((task.task_id, attempt, index), 0)
            self._partials[(task.task_id, attempt, index)] = partial + 1
        event = ImageGenerated(
            task_id=task.task_id,
            origin=self._me.node_id,
            index=index,
            partial=partial,
            png=record,
            seed=image.seed if isinstance(image, GeneratedImage) else None,
            attempt=attempt,
        )
        which = "final" if partial is None else f"partial{partial}"
        await self._chunks.publish(event, msg_id=f"image:{task.task_id}:{attempt}:{index}:{which}")
        if partial is None:
            self._partials.pop((task.task_id, attempt, index), None)


def _size(image: GeneratedImage | bytes, task: TaskCreated) -> tuple[int, int]:
    if isinstance(image, GeneratedImage):
        return image.width, image.height
    assert task.image is not None
    return task.image.width, task.image.height


async def run_diffusers(
    spec: RunnerSpec, nc: Client, me: RunnerIdentity, state: StateReporter, stop: asyncio.Event
) -> None:
    """An image model's runner: its pipeline loaded whole, on the CPU (placement gives it one
    device; CUDA is for a later step), serving until asked to stop."""
    from inference.engines.diffusion.engine import DiffusersEngine
    from services.runner.weights import shard_weights

    path = await shard_weights(spec, nc, state)
    await state.report("Loading", progress=0.0)
    engine = DiffusersEngine(path, n_threads=spec.n_threads)
    await asyncio.to_thread(engine.load)
    server = ImageServer(nc, engine, me, Path(spec.task_file) if spec.task_file else None)
    await server.start()
    await state.report("Ready", progress=1.0, slots=server.slots)
    try:
        await server.serve_forever(stop)
    finally:
        await asyncio.to_thread(engine.unload)
