"""What one attempt of a task publishes, in order, and only while it is the task's newest
attempt (``fence.py``): ``TaskStarted`` with the first chunk, the chunks and prompt scores in
groups, then the outcome. Once the fence says the task was continued elsewhere, it publishes
nothing more: a group or an outcome raises ``Superseded`` instead, and a failure is nobody's.

``TaskStarted``, the runner's Running and the look for an early cancel wait for the first
group to be out (or for the end of a task that has none): sent while the prompt was
processed, their work here, in the nats-server and in every consumer of the log took CPU from
it (docs/runners.md). The outcome is published after them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from bus.publisher import ChunkPublisher, Publisher
from events.attempts import chunk_msg_id, outcome_msg_id, scored_msg_id
from events.catalogue import ChunkGenerated, TaskCompleted, TaskCreated, TaskFailed, TaskStarted
from events.records import FinishReason, Timings, Usage
from inference.generation import ScoredPrompt, Step
from inference.job import prompt_scored
from inference.step_feed import Made
from services.runner.claim import Claim
from services.runner.fence import Fence, Superseded
from services.runner.state_reporter import RunnerIdentity


class AttemptPublisher:
    """Publishes one attempt of ``task`` (received at ``received``, ``time.perf_counter()``).
    With ``TaskStarted``, ``report_running`` (the runner's state), and once it is stored the
    claim is done; ``after_first``: other work that waits for the first group (the look for an
    early cancel)."""

    def __init__(
        self,
        fence: Fence,
        events: Publisher,
        chunks: ChunkPublisher,
        task: TaskCreated,
        me: RunnerIdentity,
        received: float,
        claim: Claim,
        report_running: Callable[[], Awaitable[None]],
        after_first: Callable[[], Awaitable[object]],
    ) -> None:
        self._fence = fence
        self._events = events
        self._chunks = chunks
        self._task = task
        self._me = me
        self._received = received
        self._claim = claim
        self._report_running = report_running
        self.attempt = fence.attempt
        self._first_out = asyncio.Event()
        # (The work is passed as a function: a coroutine handed to gather() starts at once.)
        self._announced = asyncio.ensure_future(self._after_first(self._announce))
        self._looked = asyncio.ensure_future(self._after_first(after_first))
        # What the outcome says, counted from the steps published.
        self.prompt_tokens = 0
        self.cached_tokens = 0  # the prompt's tokens the engine's cache held (the engine's thread)
        self._n = 0
        self._first: float | None = None
        self._reasoning = 0  # of the n, the thinking's (the last step counts them)
        self._finish: FinishReason = "length"
        self._sized = False  # the prompt's size went with the attempt's first chunk

    async def _after_first(self, work: Callable[[], Awaitable[object]]) -> None:
        await self._first_out.wait()
        await work()

    async def _announce(self) -> None:
        # Only the newest attempt says it started. An error before any chunk (a part read that
        # timed out in a stall, say) comes here without the fence having read the log.
        if not await self._fence.holds():
            return
        me, task = self._me, self._task
        started = TaskStarted(
            task_id=task.task_id,
            model_id=task.model_id,
            origin=me.node_id,
            runner_id=me.runner_id,
            instance_id=me.instance_id,
        )
        await asyncio.gather(self._events.publish(started), self._report_running())
        await self._claim.done()

    def cached(self, tokens: int) -> None:
        """How many of the prompt's tokens the engine's cache held (on the engine's thread,
        before its first step)."""
        self.cached_tokens = tokens

    def resumed(self, tokens: int) -> None:
        """A continuation's tokens published before (they count as generated)."""
        self._n = tokens

    async def publish(self, made: list[Made]) -> None:
        """A group of steps, as chunks (and prompt scores)."""
        if not await self._fence.holds():
            self.first_out()
            raise Superseded(self._task.task_id)
        task, attempt = self._task, self.attempt
        for m in made:
            if isinstance(m.step, ScoredPrompt):
                for scored in prompt_scored(task, m.step, self._me.node_id, m.ts):
                    msg_id = scored_msg_id(task.task_id, attempt, scored.start)
                    await self._chunks.publish(scored, msg_id=msg_id)
                continue
            if m.step.token_id is not None:
                self._n += 1
                self._first = self._first or m.at
            else:
                self._finish = m.step.finish_reason or "stop"
                self._reasoning = m.step.reasoning_tokens
            counts = None if self._sized else (self.prompt_tokens, self.cached_tokens)
            self._sized = True
            msg_id = chunk_msg_id(task.task_id, attempt, m.step.idx)
            await self._chunks.publish(self._chunk(m.step, m.ts, counts), msg_id=msg_id)
        self.first_out()

    def first_out(self) -> None:
        """The first group is out (or none will be): what waited for it goes."""
        self._first_out.set()

    async def complete(self) -> None:
        """The outcome, once every chunk is stored and the start announced."""
        self.first_out()
        await self._chunks.flush()
        await self._announced
        if not await self._fence.holds():  # (its last chunk is out: only a race gets here)
            raise Superseded(self._task.task_id)
        task, me = self._task, self._me
        end = time.perf_counter()
        first = self._first or end
        decode_s = end - first
        n = self._n
        await self._events.publish(
            TaskCompleted(
                task_id=task.task_id,
                model_id=task.model_id,
                origin=me.node_id,
                runner_id=me.runner_id,
                finish_reason=self._finish,
                attempt=self.attempt,
                usage=Usage(
                    prompt_tokens=self.prompt_tokens,
                    completion_tokens=n,
                    cached_tokens=self.cached_tokens,
                    reasoning_tokens=self._reasoning,
                ),
                timings=Timings(
                    ttft_ms=(first - self._received) * 1000,
                    tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                    total_ms=(end - self._received) * 1000,
                ),
            ),
            msg_id=outcome_msg_id(task.task_id, self.attempt),
        )

    async def fail(self, failed: TaskFailed) -> None:
        """The attempt's failure, after its start was announced; a superseded attempt's
        failure is nobody's."""
        self.first_out()
        await self._announced
        if not self._fence.superseded:
            await self._events.publish(failed, msg_id=outcome_msg_id(failed.task_id, self.attempt))

    def abandon(self) -> None:
        """Superseded: nothing more is said, not even that it started."""
        self._announced.cancel()

    def close(self) -> None:
        self._looked.cancel()

    def _chunk(self, step: Step, ts: float, prompt: tuple[int, int] | None) -> ChunkGenerated:
        """``prompt``: the prompt's tokens and those of them the cache held, on the first."""
        return ChunkGenerated(
            task_id=self._task.task_id,
            idx=step.idx,
            text=step.text,
            reasoning=step.reasoning,
            token_id=step.token_id,
            finish_reason=step.finish_reason,
            logprob=step.logprob,
            tool_calls=step.tool_calls,
            stop_sequence=step.stop_sequence,
            prompt_tokens=None if prompt is None else prompt[0],
            cached_tokens=None if prompt is None else prompt[1],
            attempt=self.attempt,
            origin=self._me.node_id,
            ts=datetime.fromtimestamp(ts, UTC),
        )
