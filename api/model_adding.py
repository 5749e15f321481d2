"""Adding a catalogue model the cluster does not know yet, when an instance of it is asked for
(``POST /v1/instances``), as ``shoal models add`` would: its weights resolved on this API's
machine (a package's file, the Hub cache, else a download), linked into this machine's
worker's cache (``shoal up``: it gives them to other nodes) or else stored in the models
bucket, ``ModelAdded`` published; then the request goes on once the projection has the model.

A request asks for it only once its card's estimate fits the cluster (checked by the caller),
so nothing is downloaded for a model that could not be placed. Two requests for the same model
in one API process share one add, and when every request waiting for it has gone (a client
that left a pull), a download under way stops (the Hub's cache keeps what it fetched).
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from api import projection
from api.config import ApiConfig
from api.context import ApiContext
from api.errors import ApiError
from projectors.state import ClusterState
from services.models.cache_budget import download_refusal
from services.models.cards import ModelCard

POLL_S = 0.2
# How long the projection may take to show a model once its ModelAdded is stored.
PROJECTED_WITHIN_S = 30.0

Fraction = Callable[[float], None]


@dataclass
class _Adding:
    """An add under way, the requests waiting for it, and its download's stop."""

    done: asyncio.Future[None]
    stop: threading.Event = field(default_factory=threading.Event)
    waiting: int = 0


_adding: dict[str, _Adding] = {}


async def add_model(
    ctx: ApiContext,
    card: ModelCard,
    on_fetch: Fraction | None = None,
    on_store: Fraction | None = None,
) -> ClusterState:
    """Add ``card``'s model to the cluster; the projection once it has it. ``ApiError`` 503
    (``model_unavailable``) when its weights cannot be had here (offline, gated...).
    ``on_fetch`` and ``on_store`` get the fetch's and the store's fractions (the first from
    another thread), for the request that started the add."""
    running = _adding.get(card.id)
    if running is None or running.stop.is_set():  # none, or one stopping: a new one
        require_room(ctx.config, card)
        stop = threading.Event()
        adding = _Adding(asyncio.ensure_future(_add(ctx, card, on_fetch, on_store, stop)), stop)
        _adding[card.id] = running = adding
        adding.done.add_done_callback(
            lambda _: _adding.pop(card.id) if _adding.get(card.id) is adding else None
        )
    running.waiting += 1
    try:
        await asyncio.shield(running.done)
    except asyncio.CancelledError:
        if running.waiting == 1 and not running.done.done():
            running.stop.set()  # the last request waiting for it left
        raise
    finally:
        running.waiting -= 1
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PROJECTED_WITHIN_S
    while (state := await projection.cluster(ctx.engine)).model(card.id) is None:
        if loop.time() > deadline:
            raise ApiError(503, f"{card.id} was added, but the projection has not shown it yet")
        await asyncio.sleep(POLL_S)
    # The names read before lack it: a request right after this one (`/api/ps` after an
    # on-demand chat, a chat after a pull), within their second, did not find it.
    ctx.names_in(state)
    return state


def require_room(config: ApiConfig, card: ModelCard) -> None:
    """The 507 of a model whose download would not fit this node's disk or weights cache,
    before anything is fetched."""
    if card.estimate is None:
        return  # its size is known once its header is read: the fetch checks the disk then
    needed = card.estimate.size_bytes + card.estimate.projector_bytes
    where = _existing(config.models_dir)
    usage = shutil.disk_usage(where)
    budget = config.cache_size.budget(usage.total) if config.cache_size is not None else None
    why = download_refusal(card.id, needed, usage.free, budget)
    if why is not None:
        raise ApiError(507, f"{why}: it was not downloaded", code="insufficient_storage")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


async def _add(
    ctx: ApiContext,
    card: ModelCard,
    on_fetch: Fraction | None,
    on_store: Fraction | None,
    stop: threading.Event,
) -> None:
    # Imported here: they pull in the Hub's client and the GGUF reader, which only an add needs.
    from services.models.add import add_model as add_to_cluster
    from services.models.metadata import GgufError
    from services.models.resolve import FetchStopped, ModelUnavailable
    from services.models.shared import WeightsUnavailable

    try:
        await add_to_cluster(
            ctx.nc.jetstream(),
            card,
            ctx.config.models_dir,
            served_from=ctx.config.served_from(),
            origin=ctx.origin,
            on_fetch=on_fetch,
            on_store=on_store,
            stop=stop,
        )
    except FetchStopped as exc:
        raise ApiError(503, f"{card.id} was not added: {exc}", code="model_unavailable") from None
    except (ModelUnavailable, GgufError, WeightsUnavailable) as exc:
        raise ApiError(
            503, f"{card.id} could not be added: {exc}", code="model_unavailable"
        ) from None
