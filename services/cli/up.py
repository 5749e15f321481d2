"""`shoal up`: a working cluster on one machine, in one command.

It starts the embedded nats-server (JetStream in the data directory), the projector (SQLite in
the data directory by default), a planner, a worker for this machine, and the API; then asks
for an instance of a model (SmolLM2 by default) and prints a ready line once that model can
answer. Ctrl-C (SIGINT or SIGTERM) stops every part: the worker stops its runners and says
NodeLeft, the API stops listening, the projector commits what it has.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated

import typer
from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine

from api.config import ApiConfig, keys_from_env
from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port, port_in_use
from bus.events import InstanceRequested
from bus.publisher import Publisher
from bus.streams import StreamSettings
from projectors import database
from projectors.projector import Projector, tune_gc
from projectors.store import load_state
from services.cli.api import ApiKeys, api_server, check_port_free, serve_until
from services.cli.models import publish_model
from services.cli.options import DataHost, default_data_dir, run_until_signal, setup_logging
from services.models.cards import builtin_cards
from services.planner.planner import PLANNING_TABLES, Planner
from services.worker.identity import node_id as load_node_id
from services.worker.profile import parse_memory_limit
from services.worker.worker import Worker, WorkerConfig

DEFAULT_NATS_PORT = 4222
DEFAULT_MODEL = "smollm2-135m"
log = logging.getLogger(__name__)


def up(
    data_dir: Annotated[
        Path | None, typer.Option(help="Where the log, database and models live.")
    ] = None,
    host: Annotated[str, typer.Option(help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the API.")] = 8000,
    nats_port: Annotated[
        int | None,
        typer.Option(help="Port of the embedded nats-server [default: 4222, or a free one]."),
    ] = None,
    nats_host: Annotated[str, typer.Option(help="Address the nats-server listens on.")] = (
        "127.0.0.1"
    ),
    db: Annotated[str | None, typer.Option(help="Projection database URL.")] = None,
    model: Annotated[str, typer.Option(help="Model to serve once up.")] = DEFAULT_MODEL,
    no_model: Annotated[bool, typer.Option("--no-model", help="Serve no model.")] = False,
    memory_limit: Annotated[
        str | None, typer.Option(help="Memory this machine's worker offers, e.g. 512M, 8G.")
    ] = None,
    runner_threads: Annotated[
        int | None, typer.Option(help="Threads per runner [default: every core].")
    ] = None,
    data_host: DataHost = None,
    api_key: ApiKeys = None,
) -> None:
    """Start a one-machine Shoal: NATS, projector, planner, worker and API, serving a model."""
    setup_logging()
    for noisy in ("services", "alembic", "projectors"):  # the ready lines are what matter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tune_gc()
    data = data_dir or default_data_dir()
    db_url = db or f"sqlite:///{data / 'shoal.db'}"
    limit = parse_memory_limit(memory_limit) if memory_limit else None
    if not no_model and model not in builtin_cards():
        known = ", ".join(sorted(builtin_cards()))
        typer.echo(f"error: --model must be a built-in model ({known}); add others with"
                   " `shoal models add` and `shoal instances create`", err=True)  # fmt: skip
        raise typer.Exit(1)
    check_port_free(host, port, "API", "--port")
    nats_port_ = nats_port
    if nats_port_ is None:
        # The usual port, unless something (often a system nats-server) has it already; a port
        # the user asked for is never swapped.
        nats_port_ = DEFAULT_NATS_PORT
        if port_in_use(nats_host, nats_port_):
            nats_port_ = free_port(nats_host)
            typer.echo(f"port {DEFAULT_NATS_PORT} is in use; the embedded NATS uses {nats_port_}")
    server = EmbeddedNats(data / "nats", port=nats_port_, host=nats_host)
    server.start()
    api_url = f"http://{host}:{port}/v1"
    keys = frozenset(api_key or ()) | keys_from_env()

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(server.url, name="shoal-up")
        worker_nc = await connect(server.url, name="shoal-up-worker")
        engine = database.create_engine(db_url)
        projector = Projector(nc.jetstream(), engine, stream_settings=StreamSettings.from_env())
        tasks = [asyncio.create_task(projector.run(stop))]
        try:
            await _first(projector.ready.wait(), tasks[0])
            worker_dir = data / "worker"
            worker = Worker(worker_nc, WorkerConfig(
                nats_url=server.url, node_id=load_node_id(worker_dir, None), data_dir=worker_dir,
                memory_limit=limit, runner_threads=runner_threads, data_host=data_host,
            ))  # fmt: skip
            api = api_server(
                ApiConfig(nats_url=server.url, db_url=db_url, api_keys=keys), host, port
            )
            tasks += [
                asyncio.create_task(Planner(nc, engine, origin="planner@up").run(stop)),
                asyncio.create_task(worker.run(stop)),
                asyncio.create_task(serve_until(api, stop)),
            ]
            typer.echo(f"API       {api_url}" + (" (API keys required)" if keys else ""))
            typer.echo(f"NATS      {server.url}")
            typer.echo(f"database  {db_url}")
            if no_model:
                typer.echo(f"ready: {api_url} (no model requested; Ctrl-C stops)")
            else:
                waiting = asyncio.create_task(_serve_model(nc, engine, model, data / "models"))
                await _first(waiting, *tasks, stop.wait())
                if waiting.done() and waiting.exception() is None:
                    typer.echo(
                        f"ready: {model} answers at {api_url}/chat/completions (Ctrl-C stops)"
                    )
                waiting.cancel()
            await asyncio.gather(*tasks)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.dispose()
            await worker_nc.drain()
            await nc.drain()

    try:
        run_until_signal(main)
    finally:
        server.stop()
    typer.echo("stopped")


async def _first(*aws: Awaitable[object]) -> None:
    """Until the first of these finishes (a failed service ends the wait too)."""
    futures = [asyncio.ensure_future(a) for a in aws]
    done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for f in done:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            raise error


async def _serve_model(nc: Client, engine: AsyncEngine, model_id: str, models_dir: Path) -> None:
    """Make the model known and ask for an instance of it, unless a live one exists already
    (a restart), then wait until one of its runners is ready."""
    async with engine.connect() as conn:
        state = await load_state(conn, PLANNING_TABLES)
    js = nc.jetstream()
    if state.model(model_id) is None:
        typer.echo(f"preparing {model_id}...")
        await publish_model(js, builtin_cards()[model_id], models_dir)
    live = [
        i
        for i in state.instances()
        if i.model_id == model_id and i.status in ("requested", "placed")
    ]
    if not live:
        await Publisher(js).publish(
            InstanceRequested(instance_id=f"{model_id}-up", model_id=model_id, origin="shoal-up")
        )
    said: set[str] = set()
    while True:
        async with engine.connect() as conn:
            state = await load_state(conn, PLANNING_TABLES)
        for inst in state.instances():
            if inst.model_id != model_id:
                continue
            if inst.status == "rejected" and inst.reason and inst.reason not in said:
                said.add(inst.reason)
                typer.echo(f"{model_id} cannot be placed: {inst.reason}", err=True)
            heads = [r for r in state.runners_of(inst.instance_id) if r.rank == 0]
            if any(r.state in ("Ready", "Running") for r in heads):  # a pipeline's head serves
                return
        await asyncio.sleep(0.3)
