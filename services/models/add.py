"""Making a model known to the cluster, as ``shoal models add`` does it: its weights resolved on
this machine (a path, a package's file, a download), their facts read, their files linked into
the cache of this machine's worker, which serves them to other nodes (or, where no worker
runs, stored in the models bucket), and ``ModelAdded`` published naming them.

Kept local (``--local``), the files stay where they are and the event names the path and the
one node that has it instead: no other node may run the model.

A model that reads images has a projector file (``ModelCard.projector``), fetched, linked or
stored as the weights are (a local model's too: it is named by its content, as a shared
model's files), and named among the event's files (``WeightFile.projector``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from nats.js import JetStreamContext

from bus.publisher import Publisher
from events.catalogue import ModelAdded
from services.models.cards import ModelCard
from services.models.metadata import ModelFacts, model_facts
from services.models.resolve import resolve_model, resolve_projector
from services.models.shared import WeightsUnavailable, model_files, store_files
from services.models.weights_cache import WeightsCache

Fraction = Callable[[float], None]


async def add_model(
    js: JetStreamContext,
    card: ModelCard,
    cache_dir: Path,
    *,
    local_node: str | None = None,
    served_from: WeightsCache | None = None,
    origin: str | None = None,
    on_fetch: Fraction | None = None,
    on_store: Fraction | None = None,
    stop: threading.Event | None = None,
) -> tuple[ModelAdded, Path, int]:
    """Fetch the card's weights here (if not here yet), read their facts, link their files into
    ``served_from`` (the cache of this machine's worker, which serves them to other nodes) or,
    without it, store them in the models bucket (``local_node`` given: keep them at their path,
    served by that node only), publish ``ModelAdded``. ``on_fetch`` and ``on_store`` get
    fractions, the first from another thread; ``stop``, once set, ends a download under way
    (``FetchStopped``). Returns the event, the weights' path here and the event's sequence."""

    def fetch() -> tuple[Path, ModelFacts, Path | None]:
        weights = resolve_model(card, cache_dir, on_fetch, stop=stop)
        projector = resolve_projector(card, cache_dir, on_fetch, stop=stop)
        return weights, model_facts(weights, card.engines[0]), projector

    # In a thread, so that the connection keeps answering pings during a download.
    weights, facts, projector = await asyncio.to_thread(fetch)

    def stored(done: int, total: int) -> None:
        if on_store is not None and total:
            on_store(done / total)

    cache = served_from or WeightsCache(cache_dir)
    files = []
    if local_node is None:
        files = await store_files(
            js, model_files(weights), cache=cache, on_progress=stored, put=served_from is None
        )
    if projector is not None:
        if projector.name in {f.name for f in files} or projector == weights:
            raise WeightsUnavailable(f"the projector {projector} is the weights' own file")
        kept = await store_files(
            js, [(projector.name, projector)], cache=cache, put=served_from is None
        )
        files += [f.model_copy(update={"projector": True}) for f in kept]
    event = ModelAdded(
        origin=origin or f"shoal-cli@{socket.gethostname()}",
        model_id=card.id,
        family=card.family,
        n_layers=facts.n_layers,
        context_length=facts.context_length,
        size_bytes=facts.size_bytes,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        overhead_bytes=facts.overhead_bytes,
        engines=list(card.engines),
        chat_format=card.chat_format,
        source=card.source.label(),
        path=str(weights) if local_node is not None else None,
        files=files,
        node_id=local_node,
        vision=facts.vision,
    )
    ack = await Publisher(js).publish(event)
    return event, weights, ack.seq
