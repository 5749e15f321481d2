"""Who a runner is, and how it says where it stands (``RunnerStateChanged``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from nats.aio.client import Client

from bus.publisher import Publisher
from events.catalogue import RunnerStateChanged
from events.states import RunnerState


@dataclass(frozen=True)
class RunnerIdentity:
    runner_id: str
    instance_id: str
    model_id: str
    node_id: str


class StateReporter:
    """Publishes this runner's RunnerStateChanged events."""

    def __init__(self, nc: Client, me: RunnerIdentity) -> None:
        self._events = Publisher(nc.jetstream())
        self._me = me

    async def report(self, state: RunnerState, **fields: object) -> None:
        me = self._me
        await self._events.publish(
            RunnerStateChanged.model_validate(
                {
                    "runner_id": me.runner_id,
                    "instance_id": me.instance_id,
                    "node_id": me.node_id,
                    "state": state,
                    "origin": me.node_id,
                    "pid": os.getpid(),
                    **fields,
                }
            )
        )
