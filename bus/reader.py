"""Reading a range of a stream once, in order, without taking part in delivery (replay, dump)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.leaderless import ask_again
from bus.puller import NoResponders, Puller

FETCH_TIMEOUT_S = 2.0
STALLED_S = 60.0  # a consumer with messages pending that delivers none for this long has failed


async def read_stream(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    from_seq: int = 1,
    to_seq: int | None = None,
    batch_size: int = 5000,
) -> AsyncGenerator[Msg, None]:
    """Yield the messages of ``stream`` matching ``subject`` with ``from_seq <= seq <= to_seq``
    (``to_seq`` defaults to the stream's last sequence when reading starts)."""
    # Asked again while the stream or its consumers have no leader (a server of a cluster lost).
    info = await ask_again(lambda: js.stream_info(stream), what=f"{stream}'s info")
    end = info.state.last_seq if to_seq is None else min(to_seq, info.state.last_seq)
    if end < max(from_seq, info.state.first_seq):
        return
    name = f"reader-{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        name=name,
        filter_subject=subject,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(from_seq, 1),
        ack_policy=AckPolicy.NONE,
        inactive_threshold=60.0,
        # One replica in memory, as nats-py's ordered consumers: a stream of replicas 3 would
        # otherwise give each read a group of its own to elect, which waits on a lost server.
        mem_storage=True,
        num_replicas=1,
    )
    await ask_again(lambda: js.add_consumer(stream, config), what=f"a reader of {stream}")
    puller = Puller(js, stream, name)
    await puller.start()
    empty = 0
    try:
        while True:
            msgs = await _fetch(puller, batch_size)
            if not msgs:
                # Nothing left that matches (the rest may have aged out) — unless the consumer
                # says otherwise: one just made on a replica that is catching up (a healed
                # server) can answer a first fetch with nothing.
                if await _pending(js, stream, name) == 0:
                    return
                empty += 1
                if empty * FETCH_TIMEOUT_S >= STALLED_S:
                    raise TimeoutError(f"{stream}: messages pending, none came in {STALLED_S} s")
                continue
            empty = 0
            for msg in msgs:
                md = msg.metadata
                if md.sequence.stream > end:
                    return
                yield msg
                # num_pending: matching messages after this one, so a filtered read ends here
                # rather than waiting out a fetch.
                if md.sequence.stream == end or md.num_pending == 0:
                    return
    finally:
        await puller.stop()
        await js.delete_consumer(stream, name)


async def _pending(js: JetStreamContext, stream: str, name: str) -> int:
    info = await ask_again(lambda: js.consumer_info(stream, name), what=f"a reader of {stream}")
    return info.num_pending or 0


async def _fetch(puller: Puller, batch_size: int) -> list[Msg]:
    """A batch, asking again while nobody answers for the consumer (no leader yet)."""
    return await ask_again(
        lambda: puller.fetch(batch_size, timeout=FETCH_TIMEOUT_S),
        retry_on=lambda exc: isinstance(exc, NoResponders),
        pause_s=0.2,
    )
