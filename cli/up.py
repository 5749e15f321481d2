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
import os
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from nats.aio.client import Client
from sqlalchemy.ext.asyncio import AsyncEngine

from api.config import DEFAULT_BODY_TIMEOUT_S, ApiConfig
from bus import local_token
from bus.cluster_secret import ENV as SECRET_ENV
from bus.cluster_secret import ClusterSecret
from bus.connection import connect
from bus.embedded import EmbeddedNats, free_port, port_in_use
from bus.log_replicas import wait_for_servers
from bus.log_replicas import watch as watch_log_replicas
from bus.nats_security import ENV as NATS_ENV
from bus.nats_security import NatsSecurity
from bus.publisher import Publisher
from bus.streams import StreamSettings
from cli.api import (
    DEFAULT_MAX_BODY_TEXT,
    Aliases,
    AllowedHosts,
    AllowImageUrls,
    ApiKeyFiles,
    ApiKeys,
    BodyTimeout,
    CorsOrigins,
    LoadOnDemand,
    MaxBody,
    MaxQueued,
    MaxTokens,
    ModelDefaultsFile,
    OnDemand,
    ReasoningBudget,
    TlsCert,
    TlsKey,
    api_keys,
    api_server,
    api_tls,
    api_url,
    check_port_free,
    cli_aliases,
    max_body_bytes,
    max_tokens_limit,
    model_defaults,
    on_demand_roles,
    reasoning_budget,
    refuse_wildcards,
    serve_until,
)
from cli.cluster import (
    HA_REPLICAS,
    ROUTE_PORT,
    UP_LOOKS_S,
    Secret,
    announce,
    discover,
    ha_peers,
    ha_server,
    lan_urls,
    use_secret,
)
from cli.exposure import refuse_exposure
from cli.models import publish_model
from cli.options import (
    DEFAULT_CACHE_SIZE_TEXT,
    DEFAULT_KEEP_ALIVE_TEXT,
    CacheSizeText,
    DataHost,
    KeepAlive,
    MaxLoaded,
    Retain,
    RunnerSlots,
    WarmRunner,
    absolute,
    cache_size,
    keep_alive_s,
    run_until_signal,
    setup_logging,
    stream_settings,
)
from cli.up_progress import UpProgress, model_steps, weights_step
from cli.worker import joining, serve_worker
from events.catalogue import InstanceRequested
from events.states import INSTANCE_LIVE, SERVING
from projectors import database
from projectors.db_url import absolute_db_url
from projectors.projector import DEFAULT_NAME, Projector, tune_gc
from projectors.store import load_state
from services.models.catalogue import builtin_cards
from services.models.weights_cache import WeightsCache
from services.paths import default_data_dir
from services.planner.decisions import PlannerPolicy
from services.planner.planner import PLANNING_TABLES, Planner
from services.worker.identity import node_id as load_node_id
from services.worker.profile import parse_memory_limit
from services.worker.worker import Worker, WorkerConfig

DEFAULT_NATS_PORT = 4222
DEFAULT_MODEL = "smollm2-135m"
log = logging.getLogger(__name__)


def up(
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Where the log, database and models live.", callback=absolute),
    ] = None,
    host: Annotated[str, typer.Option(help="Address the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the API.")] = 8000,
    nats_port: Annotated[
        int | None,
        typer.Option(help="Port of the embedded nats-server [default: 4222, or a free one]."),
    ] = None,
    nats_host: Annotated[
        str | None,
        typer.Option(
            help="Address the nats-server listens on [default: every address with --secret,"
            " else 127.0.0.1]."
        ),
    ] = None,
    secret: Secret = None,
    ha: Annotated[
        bool,
        typer.Option(
            "--ha",
            help="This machine's NATS server is one of a cluster of three or more, found on the"
            " LAN by --secret, the log on three of them: it survives the loss of any one"
            " machine. Start three machines so (docs/operations.md#high-availability).",
        ),
    ] = False,
    db: Annotated[str | None, typer.Option(help="Projection database URL.")] = None,
    model: Annotated[str, typer.Option(help="Model to serve once up.")] = DEFAULT_MODEL,
    context: Annotated[
        int | None,
        typer.Option(
            "--context",
            min=1,
            help="Context length in tokens of the model's instance [default: its"
            " --model-defaults context_length, else 2048 or less]; coding agents need 16k-32k.",
        ),
    ] = None,
    no_model: Annotated[bool, typer.Option("--no-model", help="Serve no model.")] = False,
    memory_limit: Annotated[
        str | None, typer.Option(help="Memory this machine's worker offers, e.g. 512M, 8G.")
    ] = None,
    runner_threads: Annotated[
        int | None, typer.Option(help="Threads per runner [default: every core].")
    ] = None,
    data_host: DataHost = None,
    slots: RunnerSlots = None,
    cache_size_text: CacheSizeText = DEFAULT_CACHE_SIZE_TEXT,
    warm_runner: WarmRunner = True,
    api_key: ApiKeys = None,
    api_key_file: ApiKeyFiles = None,
    alias: Aliases = None,
    cors_origin: CorsOrigins = None,
    allowed_host: AllowedHosts = None,
    max_queued: MaxQueued = None,
    max_body: MaxBody = DEFAULT_MAX_BODY_TEXT,
    body_timeout: BodyTimeout = DEFAULT_BODY_TIMEOUT_S,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    retain: Retain = "30d",
    keep_alive: KeepAlive = DEFAULT_KEEP_ALIVE_TEXT,
    load_on_demand: LoadOnDemand = True,
    on_demand: OnDemand = "admins",
    reasoning_budget_tokens: ReasoningBudget = -1,
    max_tokens: MaxTokens = -1,
    allow_image_urls: AllowImageUrls = False,
    max_loaded: MaxLoaded = None,
    model_defaults_file: ModelDefaultsFile = None,
    nats_tls_cert: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            callback=absolute,
            help="Certificate of the embedded nats-server: clients"
            " must use TLS (give them the CA with --nats-ca).",
        ),
    ] = None,
    nats_tls_key: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            callback=absolute,
            help="The key of --nats-tls-cert.",
        ),
    ] = None,
) -> None:
    """Start a one-machine Shoal: NATS, projector, planner, worker and API, serving a model."""
    setup_logging()
    for noisy in ("services", "alembic", "projectors"):  # the ready lines are what matter
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tune_gc()
    data = data_dir or default_data_dir()
    cluster = use_secret(secret)

    def worker_config() -> WorkerConfig:
        """This machine's worker: made once the command is known to start (its node id is
        written on first use)."""
        return WorkerConfig(
            nats_url="",
            node_id=load_node_id(data / "worker", None),
            data_dir=data / "worker",
            memory_limit=parse_memory_limit(memory_limit) if memory_limit else None,
            runner_threads=runner_threads,
            data_host=data_host,
            slots=slots,
            cache_size=cache_size(cache_size_text),
            warm_runner=warm_runner,
        )

    if ha and cluster is None:
        typer.echo(
            "error: --ha needs the cluster's secret (--secret or SHOAL_CLUSTER_SECRET)", err=True
        )
        raise typer.Exit(1)
    if cluster is not None and not ha and (found := discover(cluster, UP_LOOKS_S, quiet=True)):
        # A second cluster of the same secret would split the machines: join the first.
        urls = joining(found)
        typer.echo("this machine joins it as a worker (as `shoal join` does)")
        serve_worker(replace(worker_config(), nats_url=urls))
        return
    nats_host = nats_host or ("0.0.0.0" if cluster is not None else "127.0.0.1")
    db_url = absolute_db_url(db) if db else f"sqlite:///{data / 'shoal.db'}"
    policy = PlannerPolicy(default_keep_alive_s=keep_alive_s(keep_alive), max_loaded=max_loaded)
    if not no_model and model not in builtin_cards():
        known = ", ".join(sorted(builtin_cards()))
        typer.echo(
            f"error: --model must be a built-in model ({known}); add others with"
            " `shoal models add` and `shoal instances create`",
            err=True,
        )
        raise typer.Exit(1)
    tls = api_tls(tls_cert, tls_key)
    settings = stream_settings(retain)
    if ha:
        # Every process this one starts, and every stream it makes: three replicas.
        settings = replace(settings or StreamSettings(), replicas=HA_REPLICAS)
        os.environ["SHOAL_STREAM_REPLICAS"] = str(HA_REPLICAS)
    if (nats_tls_cert is None) != (nats_tls_key is None):
        typer.echo("error: --nats-tls-cert and --nats-tls-key go together", err=True)
        raise typer.Exit(1)
    keys = api_keys(api_key, api_key_file)
    aliases = cli_aliases(alias)
    defaults = model_defaults(model_defaults_file, aliases)
    body_limit = max_body_bytes(max_body)
    thinking_budget = reasoning_budget(reasoning_budget_tokens)
    output_limit = max_tokens_limit(max_tokens)
    security = NatsSecurity.from_env()
    exposed = refuse_exposure(host, nats_host, keys, security) or refuse_wildcards(
        keys, allowed_host, cors_origin
    )
    if exposed:
        typer.echo(f"error: {exposed}", err=True)
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
    made_token = bool(keys) and not security.authenticates
    if made_token:
        # API keys guard nothing if any local user can publish KeyAdded on the log: NATS
        # takes a token made here, even on loopback; this process's connections and the
        # runners it starts read it from the environment, this user's other commands from
        # the run directory (bus/local_token.py).
        token = local_token.data_token(data / "nats")
        os.environ[NATS_ENV["token"]] = token
        security = NatsSecurity.from_env()
        local_token.register(nats_port_, token)
    worker = worker_config()
    joins = lan_urls("nats", nats_host, nats_port_)
    api_lan = next(iter(lan_urls("https" if tls else "http", host, port)), "")
    own_route = lan_urls("nats-route", nats_host, ROUTE_PORT)[:1] if ha else []
    announcer = None
    if cluster is not None and joins:
        announcer = announce(cluster, worker.node_id, joins, api_lan, own_route)
        # Before looking for peers: two machines started at once see each other.
        announcer.start()
    ha_srv = None
    if cluster is not None and ha:
        ha_srv = ha_server(cluster, own_route, ha_peers(cluster, worker.node_id))
    routes = ha_srv.routes if ha_srv is not None else []
    server = EmbeddedNats(
        data / "nats",
        port=nats_port_,
        host=nats_host,
        server_name=worker.node_id if ha_srv is not None else "shoal",
        security=security,
        tls_cert=nats_tls_cert,
        tls_key=nats_tls_key,
        cluster_name=ha_srv.name if ha_srv is not None else None,
        cluster_port=ROUTE_PORT if ha_srv is not None else None,
        routes=routes,
        route_password=ha_srv.password if ha_srv is not None else None,
    )
    server.start()
    url = api_url(host, port, tls)

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(server.url, name="shoal-up")
        worker_nc = await connect(server.url, name="shoal-up-worker")
        engine = database.create_engine(db_url)
        if ha and settings is not None:
            await wait_for_servers(nc.jetstream(), settings, typer.echo)
        # With --ha every machine has a projection of its own: its projector a consumer of its own.
        name = f"up-{worker.node_id}" if ha else DEFAULT_NAME
        projector = Projector(nc.jetstream(), engine, name=name, stream_settings=settings)
        tasks = [asyncio.create_task(projector.run(stop))]
        if ha:
            tasks.append(asyncio.create_task(watch_log_replicas(nc.jetstream(), stop)))
        try:
            await _first(projector.ready.wait(), tasks[0])
            worker_dir = data / "worker"
            node = Worker(
                worker_nc, replace(worker, nats_url=server.url, nats_listen_host=nats_host)
            )
            config = ApiConfig(
                nats_url=server.url,
                db_url=db_url,
                api_keys=keys,
                aliases=aliases,
                default_model=None if no_model else model,
                cors_origins=tuple(cors_origin or ()),
                listen_hosts=(host,),
                allowed_hosts=tuple(allowed_host or ()),
                max_body_bytes=body_limit,
                body_timeout_s=body_timeout,
                load_on_demand=load_on_demand,
                on_demand=on_demand_roles(on_demand),
                reasoning_budget=thinking_budget,
                max_tokens=output_limit,
                allow_image_urls=allow_image_urls,
                default_keep_alive_s=policy.default_keep_alive_s,
                model_defaults=defaults,
                models_dir=data / "models",
                worker_models_dir=worker_dir / "models",
                cache_size=worker.cache_size,
                max_queued=max_queued,
                projector=name,
            )
            api = api_server(config, host, port, tls)
            tasks += [
                asyncio.create_task(
                    Planner(nc, engine, policy, origin="planner@up", projector=name).run(stop)
                ),
                asyncio.create_task(node.run(stop)),
                asyncio.create_task(serve_until(api, stop)),
            ]
            typer.echo(f"API       {url}" + (" (API keys required)" if keys else ""))
            typer.echo(f"NATS      {server.url} ({security.describe()})")
            if made_token:
                typer.echo(
                    f"          its token: {data / 'nats' / local_token.TOKEN_FILE} (yours"
                    " alone; your commands here find it, others take --nats-token-file)"
                )
            typer.echo(f"database  {db_url}")
            root = url.removesuffix("/v1")
            typer.echo(
                f"clients   OpenAI {url}, Anthropic and Ollama {root} (/v1/messages, /api/chat)"
            )
            if joins:
                typer.echo(f"join      on another machine: {join_line(cluster, joins[0])}")
            if no_model:
                # Ready once this node can be placed on: a request then loads its model.
                await _first(_node_online(engine, node.node_id), *tasks, stop.wait())
                typer.echo(f"ready: {url} (no model requested; Ctrl-C stops)")
            else:
                own = [name for name, target in aliases.items() if target == model]
                given = defaults.for_model(model, lambda name: aliases.get(name, name))
                length = context or (given.context_length if given is not None else None)
                waiting = asyncio.create_task(_serve_model(nc, engine, model, data, own, length))
                await _first(waiting, *tasks, stop.wait())
                if waiting.done() and waiting.exception() is None:
                    typer.echo(f"ready: {model} answers at {url}/chat/completions (Ctrl-C stops)")
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
        if announcer is not None:
            announcer.stop()
        server.stop()
        if made_token:
            local_token.unregister(nats_port_)
    typer.echo("stopped")


def join_line(cluster: ClusterSecret | None, nats_url: str) -> str:
    """What another machine runs to join this one."""
    if cluster is not None:
        return f"shoal join (with the same {SECRET_ENV}; or: shoal join --nats {nats_url})"
    return f"shoal join --nats {nats_url} (with the same NATS credentials)"


async def _first(*aws: Awaitable[object]) -> None:
    """Until the first of these finishes (a failed service ends the wait too)."""
    futures = [asyncio.ensure_future(a) for a in aws]
    done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for f in done:
        error = None if f.cancelled() else f.exception()
        if error is not None:
            raise error


async def _node_online(engine: AsyncEngine, node_id: str) -> None:
    """Until the projection has this node online, with its resources."""
    while True:
        async with engine.connect() as conn:
            state = await load_state(conn, PLANNING_TABLES)
        node = state.node(node_id)
        if node is not None and node.status == "online" and node.memory_offered:
            return
        await asyncio.sleep(0.1)


async def _serve_model(
    nc: Client,
    engine: AsyncEngine,
    model_id: str,
    data: Path,
    aliases: list[str],
    context_length: int | None = None,
) -> None:
    """Make the model known and ask for an instance of it (called by ``aliases`` too, so that
    every API process knows them; of ``context_length`` tokens, None: the planner's default),
    unless a live one exists already (a restart), then wait
    until one of its runners is ready, showing each step's progress. The weights stay where
    they are, linked into this machine's worker's cache, which gives them to other nodes."""
    async with engine.connect() as conn:
        state = await load_state(conn, PLANNING_TABLES)
    js = nc.jetstream()
    with UpProgress() as progress:
        if state.model(model_id) is None:
            card = builtin_cards()[model_id]
            source = card.source.label()
            progress.show([weights_step(model_id, None, source)])
            await publish_model(
                js,
                card,
                data / "models",
                lambda f: progress.show([weights_step(model_id, f, source)]),
                served_from=WeightsCache(data / "worker" / "models"),
            )
        live = [
            i for i in state.instances() if i.model_id == model_id and i.status in INSTANCE_LIVE
        ]
        other = [i for i in live if context_length not in (None, i.context_length)]
        if other and len(other) == len(live):
            # A restart keeps the instance it made before: say so rather than ignore --context.
            typer.echo(
                f"{other[0].instance_id} serves a context of {other[0].context_length} tokens,"
                f" not {context_length}: `shoal instances delete {other[0].instance_id}` and"
                " start again to change it"
            )
        if not live:
            await Publisher(js).publish(
                InstanceRequested(
                    instance_id=f"{model_id}-up",
                    model_id=model_id,
                    origin="shoal-up",
                    aliases=aliases,
                    context_length=context_length,
                )
            )
        while True:
            async with engine.connect() as conn:
                state = await load_state(conn, PLANNING_TABLES)
            progress.show(model_steps(state, model_id))
            for inst in state.instances():
                heads = [r for r in state.runners_of(inst.instance_id) if r.rank == 0]
                # A pipeline's head serves.
                if inst.model_id == model_id and any(r.state in SERVING for r in heads):
                    return
            await asyncio.sleep(0.3)
