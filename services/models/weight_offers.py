"""Finding a node that holds weight files, so that a runner can take them from that node's
disk rather than from a copy in the models bucket.

A runner that lacks files asks every worker at once (``WeightsWanted`` on
``events.subjects.WEIGHTS_WANTED``, core NATS request-reply); a worker whose cache holds some of
them answers with a ``WeightsOffer``: where its weights server listens and a ticket that lets
the asker read those files, and only those, for a while. The first answer is taken. Nothing of
this is in the event log: the bytes of a file are the data plane, and who holds one can change
at any moment (a node that fetched a file holds it too).
"""

from __future__ import annotations

import time

import nats.errors
from nats.aio.client import Client
from pydantic import BaseModel, ConfigDict, ValidationError

from events.catalogue import WeightFile
from events.subjects import WEIGHTS_WANTED

# How long one ask waits for an answer: a worker that holds a file answers from its event loop,
# in milliseconds.
ANSWER_WITHIN_S = 1.0


class WeightsWanted(BaseModel):
    model_config = ConfigDict(frozen=True)

    node_id: str  # the asker's node: its own worker does not answer
    files: list[WeightFile]


class WeightsOffer(BaseModel):
    model_config = ConfigDict(frozen=True)

    node_id: str
    url: str  # the weights server's root: GET <url>/blobs/<sha256>
    ticket: str  # Bearer token for these files' blobs, for a while
    sha256s: list[str]  # the files of the ask that this node holds


async def ask_for_offer(
    nc: Client, node_id: str, files: list[WeightFile], within_s: float
) -> WeightsOffer | None:
    """The first offer for any of ``files`` from another node, asking again until ``within_s``
    has passed (a holder may be reconnecting); None when nobody holds them, at once when no
    worker listens at all (in a cluster the asker's own worker does)."""
    wanted = WeightsWanted(node_id=node_id, files=files).model_dump_json().encode()
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply = await nc.request(WEIGHTS_WANTED, wanted, timeout=min(ANSWER_WITHIN_S, left))
        except nats.errors.NoRespondersError:
            return None
        except nats.errors.TimeoutError:
            continue
        try:
            offer = WeightsOffer.model_validate_json(reply.data)
        except ValidationError:
            continue
        if offer.sha256s:
            return offer
    return None
