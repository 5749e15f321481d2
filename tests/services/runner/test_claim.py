"""A pulled task is kept in progress until its runner claims it, then acked; a task delivered
again is judged from what the log holds of it."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from bus.consumer import EventConsumer
from bus.publisher import Publisher
from bus.streams import EVENTS_STREAM
from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams
from services.runner.claim import Claim, Seen, redelivered


def test_a_task_delivered_again_is_judged_by_the_log() -> None:
    assert redelivered(Seen(this=5, latest_request=9, started=0, ended=False)) == "superseded"
    assert redelivered(Seen(this=5, latest_request=9, started=11, ended=True)) == "superseded"
    assert redelivered(Seen(this=5, latest_request=5, started=7, ended=True)) == "ended"
    assert redelivered(Seen(this=5, latest_request=5, started=7, ended=False)) == "started"
    # A continuation's TaskStarted from before it is its lost runner's, not a claim of it.
    assert redelivered(Seen(this=5, latest_request=5, started=3, ended=False)) == "lost"
    assert redelivered(Seen(this=5, latest_request=5, started=0, ended=False)) == "lost"


async def test_a_claimed_task_is_kept_in_progress_then_acked(js: JetStreamContext) -> None:
    """Ack wait 1 s: a claimed task is not delivered again while its runner works on it (3 s)
    nor after it is acked; one left alone is."""
    model = "m"
    consumer = EventConsumer(
        js,
        EVENTS_STREAM,
        "tasks-m",
        TaskCreated.filter_for(model),
        deliver_policy=DeliverPolicy.NEW,
        ack_wait=1.0,
    )
    await consumer.start()
    pub = Publisher(js)
    for task_id in ("kept", "left"):
        await pub.publish(
            TaskCreated(
                task_id=task_id,
                model_id=model,
                origin="t",
                messages=[ChatMessage(role="user", content="hi")],
                params=SamplingParams(),
            )
        )
    kept, _left = await consumer.fetch(2, timeout=2.0)
    claim = Claim(kept, every_s=0.3)
    await asyncio.sleep(3.0)
    again = await consumer.fetch(2, timeout=1.0)
    assert [d.event.task_id for d in again if isinstance(d.event, TaskCreated)] == ["left"]
    await again[0].ack()
    await claim.done()
    await claim.done()  # once
    await asyncio.sleep(1.5)
    assert await consumer.fetch(2, timeout=1.0) == []
    info = await js.consumer_info(EVENTS_STREAM, "tasks-m")
    assert info.num_ack_pending == 0
    await consumer.stop()
