"""Options shared by every `shoal` command, and running a service until a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
import uvloop

from bus.connection import DEFAULT_NATS_URL
from bus.streams import StreamSettings, parse_duration
from projectors.db_url import absolute_db_url
from services.models.cache_budget import DEFAULT_CACHE_FRACTION, CacheSize, parse_cache_size
from services.models.footprint import MAX_SLOTS
from services.paths import default_data_dir
from services.planner.on_demand import parse_keep_alive

NatsUrl = Annotated[
    str,
    typer.Option("--nats", envvar="SHOAL_NATS_URL", help="NATS server URL(s), comma-separated."),
]
DbUrl = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="SHOAL_DB_URL",
        help="Projection database: sqlite:///PATH or postgresql://USER@HOST/DB.",
        callback=absolute_db_url,
    ),
]
DataHost = Annotated[
    str | None,
    typer.Option(
        envvar="SHOAL_DATA_HOST",
        help="Address this node's pipeline stages (llama.cpp RPC, MLX ring) and weights server"
        " listen on [default: one the other machines reach: the address on the route to NATS,"
        " or the LAN address where NATS is here and open to them]. Trusted networks only:"
        " llama.cpp's RPC has no authentication.",
    ),
]
RunnerSlots = Annotated[
    int | None,
    typer.Option(
        "--slots",
        min=1,
        max=MAX_SLOTS,
        help="Tasks each runner of this node serves at once, whatever its instance was placed"
        " with [default: the placement's]. Each holds a KV cache of the whole context: mind"
        " the memory.",
    ),
]
WarmRunner = Annotated[
    bool,
    typer.Option(
        "--warm-runner/--no-warm-runner",
        envvar="SHOAL_WARM_RUNNER",
        help="Keep one runner process started ahead, its imports done, for the next model this"
        " node loads (about 0.7 s of a cold start on 2 cores; bench/cold_start.py). It costs an"
        " idle process (~100 MB of RAM).",
    ),
]
Retain = Annotated[
    str | None,
    typer.Option(
        "--retain",
        envvar="SHOAL_EVENTS_MAX_AGE",
        help="How long the event log keeps an event: '30d', '12h', 0 for ever. Older state is"
        " kept in snapshots of the projection (docs/operations.md).",
    ),
]
CacheSizeText = Annotated[
    str,
    typer.Option(
        "--cache-size",
        metavar="SIZE",
        help="The most this node's weights cache holds: '50%' of the disk it is on, '200G',"
        " or -1 for no limit. Beyond it, the least recently used models no runner of the node"
        " uses are evicted (docs/models.md).",
    ),
]
DEFAULT_CACHE_SIZE_TEXT = f"{DEFAULT_CACHE_FRACTION * 100:g}%"
DEFAULT_NATS = DEFAULT_NATS_URL


def cache_size(text: str) -> CacheSize:
    """``--cache-size``, parsed (a bad one is the option's error)."""
    try:
        return parse_cache_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cache-size") from None


def stream_settings(retain: str | None) -> StreamSettings | None:
    """The streams' settings from the environment, the events' age limit from ``retain``
    (None: as the environment says, or as the streams are)."""
    settings = StreamSettings.from_env()
    if retain is None:
        return settings
    try:
        age = parse_duration(retain)
    except ValueError as exc:
        raise typer.BadParameter(f"{retain!r}: {exc}", param_hint="--retain") from None
    return replace(settings or StreamSettings(), events_max_age=age)


def absolute(path: Path | None) -> Path | None:
    """A path a user gave, made absolute against the directory the command was typed in, as it
    enters (a typer callback): whatever stores it, links to it or hands it to another process
    (a runner, the nats-server) then means the same file wherever that one runs."""
    return None if path is None else path.expanduser().absolute()


def default_db_url() -> str:
    return f"sqlite:///{default_data_dir() / 'shoal.db'}"


DEFAULT_DB = default_db_url()


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("SHOAL_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_until_signal(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run ``main(stop)``; SIGINT or SIGTERM sets ``stop`` so that it can finish cleanly."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    # uvloop: a long-running service spends much of its CPU in the event loop and its socket
    # I/O, and on a machine whose cores serve a model that time is taken from generation.
    uvloop.run(runner())


KeepAlive = Annotated[
    str,
    typer.Option(
        "--keep-alive",
        metavar="DURATION",
        help="How long a model loaded on demand (a request for a model nothing served) stays"
        " loaded once idle: seconds or 5m, 1h; -1: for ever. A request's own keep_alive"
        " (Ollama's) wins. Models asked for explicitly are never unloaded.",
    ),
]
DEFAULT_KEEP_ALIVE_TEXT = "5m"
MaxLoaded = Annotated[
    int | None,
    typer.Option(
        "--max-loaded",
        min=1,
        help="The most instances a node holds (as OLLAMA_MAX_LOADED_MODELS); past it, idle"
        " on-demand ones are unloaded to make room, least recently used first. Default: as"
        " memory allows.",
    ),
]


def keep_alive_s(text: str) -> float:
    """``--keep-alive``, parsed (a bad one is the option's error)."""
    try:
        return parse_keep_alive(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--keep-alive") from None
