"""Asking JetStream again while it cannot answer: on a NATS cluster a stream or consumer has no
leader for a few seconds after its leader's server is lost (publishes and requests then go
unanswered, "no responders" or no answer at all), and a connection being re-established fails
what is sent meanwhile. Everything that talks to JetStream asks again the same way, here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a message is published again while JetStream does not store it.
RETRY_FOR_S = 30.0
# How long a read or a consumer's creation is asked again before the error is the caller's.
NO_LEADER_WAIT_S = 15.0
# The pause before asking again, so that a caller does not ask at once.
NO_LEADER_PAUSE_S = 0.5

# "duplicate message id is in process": an earlier attempt is stored but not yet replicated.
IN_PROCESS = 10158


def retryable(exc: BaseException) -> bool:
    """Whether a request that failed this way may succeed if sent again: the stream has no
    leader at the moment, the answer was lost, an earlier attempt awaits replication, or the
    connection is being re-established."""
    if isinstance(exc, APIError) and exc.err_code == IN_PROCESS:
        return True
    return isinstance(
        exc,
        NoStreamResponseError
        | ServiceUnavailableError
        | nats.errors.TimeoutError
        | nats.errors.NoRespondersError
        | nats.errors.ConnectionReconnectingError
        | nats.errors.StaleConnectionError,
    )


async def ask_again(
    attempt: Callable[[], Awaitable[T]],
    *,
    within_s: float = NO_LEADER_WAIT_S,
    retry_on: Callable[[BaseException], bool] = retryable,
    pause_s: float = NO_LEADER_PAUSE_S,
    max_pause_s: float | None = None,
    what: str = "",
) -> T:
    """``attempt()``, made again after a pause while it fails as ``retry_on`` says, until
    another attempt would start later than ``within_s`` from now: then its error is raised.
    The pause doubles up to ``max_pause_s`` when given. ``what`` names it in the log."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + within_s
    pause = pause_s
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if not retry_on(exc) or loop.time() + pause > give_up_at:
                raise
            if what:
                log.info("%s again: %r", what, exc)
        await asyncio.sleep(pause)
        if max_pause_s is not None:
            pause = min(pause * 2, max_pause_s)
