"""The other stages of a pipeline, as the event log tells them: where each one listens, and
whether it is still there.

A stage that holds later layers reports ``Ready`` with its data-plane ``endpoint`` once it
listens. The stage that needs it (the head, for llama.cpp RPC; every rank, for an MLX ring)
waits for all of them here, and gives up on the pipeline when one of them fails or stops
afterwards: its connection is gone, and a restarted peer listens elsewhere. The worker then
restarts this runner, which waits for the peers afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from events.catalogue import RunnerStateChanged, parse_event
from events.records import ShardAssignment
from events.states import RUNNER_ENDED, SERVING, RunnerState


@dataclass(frozen=True)
class PeerView:
    shard: ShardAssignment
    state: RunnerState = "Assigned"
    endpoint: str | None = None
    error: str | None = None

    @property
    def ready(self) -> bool:
        return self.state in SERVING and self.endpoint is not None

    @property
    def listening(self) -> bool:
        return self.state in SERVING | {"Loading"} and self.endpoint is not None

    def describe(self) -> str:
        s = self.shard
        where = f"stage {s.rank + 1} of {s.world_size} (layers {s.start_layer}-{s.end_layer - 1})"
        return f"{where} on {s.node_id}: {self.state}" + (f" ({self.error})" if self.error else "")


class PeerLost(RuntimeError):
    """A stage this runner depends on failed or stopped."""


class StopWhileWaiting(Exception):
    """The runner was asked to stop while it waited for the other stages."""


def runner_subject(runner_id: str) -> str:
    return RunnerStateChanged.subject_for(runner_id)


def updated(view: PeerView, event: RunnerStateChanged) -> PeerView:
    return PeerView(view.shard, event.state, event.endpoint, event.error)


class Peers:
    """The other stages of this runner's pipeline, followed from the latest event of each."""

    def __init__(
        self, js: JetStreamContext, shards: list[ShardAssignment], stop: asyncio.Event
    ) -> None:
        self._js = js
        self._stop = stop
        self._waker: asyncio.Task[None] | None = None
        self.views = {s.runner_id: PeerView(s) for s in sorted(shards, key=lambda s: s.rank)}
        self._changed = asyncio.Event()
        self._joined: dict[str, str] = {}  # runner id -> the endpoint this runner connected to
        self.lost: str | None = None
        self._sub: JetStreamContext.PushSubscription | None = None

    async def start(self) -> None:
        subjects = [runner_subject(r) for r in self.views]
        if not subjects:
            return
        self._waker = asyncio.create_task(self._wake_on_stop())
        self._sub = await self._js.subscribe(
            subjects[0],
            cb=self._on_event,
            ordered_consumer=True,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, filter_subjects=subjects
            ),
        )

    async def _wake_on_stop(self) -> None:
        await self._stop.wait()
        self._changed.set()

    async def stop(self) -> None:
        if self._waker is not None:
            self._waker.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = parse_event(msg.data)
        except ValidationError:
            return
        if not isinstance(event, RunnerStateChanged) or event.runner_id not in self.views:
            return
        view = updated(self.views[event.runner_id], event)
        self.views[event.runner_id] = view
        joined = self._joined.get(event.runner_id)
        if (
            joined is not None
            and self.lost is None
            and (view.state in RUNNER_ENDED or (view.endpoint or joined) != joined)
        ):
            self.lost = view.describe()
        self._changed.set()

    async def wait_ready(self, timeout: float) -> list[str]:
        """The endpoints of every peer, in rank order, once all are ready. From then on a peer
        that fails or stops sets ``lost``."""
        return await self._wait(lambda v: v.ready, timeout)

    async def wait_endpoints(self, timeout: float) -> list[str]:
        """The endpoints of every peer, in rank order, once all have one (while loading). From
        then on a peer that fails or stops sets ``lost``."""
        return await self._wait(lambda v: v.listening, timeout)

    async def _wait(self, done: Callable[[PeerView], bool], timeout: float) -> list[str]:
        async def all_ready() -> None:
            while not all(done(v) for v in self.views.values()):
                if self._stop.is_set():
                    raise StopWhileWaiting
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(all_ready(), timeout)
        except TimeoutError:
            waiting = "; ".join(v.describe() for v in self.views.values() if not done(v))
            raise TimeoutError(
                f"the pipeline's other stages were not ready within {timeout:.0f} s: {waiting}"
            ) from None
        endpoints = [v.endpoint for v in self.views.values() if v.endpoint is not None]
        self._joined = {r: v.endpoint for r, v in self.views.items() if v.endpoint is not None}
        return endpoints

    async def wait_lost(self) -> str:
        """Returns (what happened) once a peer that was joined fails or stops."""
        while self.lost is None:
            self._changed.clear()
            await self._changed.wait()
        return self.lost
