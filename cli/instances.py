"""`shoal instances ...` and `shoal placement preview`: ask for models to be served, see where
they run, and try a placement before asking for it.

Requests are events (``InstanceRequested``, ``InstanceDeleteRequested``); what the cluster
looks like comes from the projection. A request is checked against the live cluster with the
planner's own ``place`` before it is published, so a placement that cannot work is refused
here, with the reason, rather than rejected later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from nats.aio.client import Client
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from bus.connection import connect
from bus.publisher import Publisher
from bus.streams import StreamSettings, ensure_streams
from cli.models import publish_model, worker_cache
from cli.options import DEFAULT_DB, DEFAULT_NATS, DbUrl, NatsUrl
from events.catalogue import (
    Event,
    InstanceDeleted,
    InstanceDeleteRequested,
    InstancePlaced,
    InstanceRequested,
    PlacementRejected,
    parse_event,
)
from events.kinds import DEFAULT_KV_CACHE, InstanceRole
from events.records import Speculative
from events.states import STARTING
from events.subjects import aggregate_filter
from projectors import database
from projectors.rules import changes_for
from projectors.state import ClusterState
from projectors.store import load_state
from services.models.catalogue import builtin_cards
from services.models.footprint import MAX_SLOTS
from services.paths import default_data_dir
from services.planner.cluster import cluster_view
from services.planner.instance_request import RequestRefused, placement_request
from services.planner.placement import (
    Placement,
    PlacementRequest,
    Rejection,
    place,
)
from services.planner.placement_spec import (
    PlacementSpecError,
    parse_placement_spec,
)
from services.planner.placement_why import gib
from services.planner.planner import PLANNING_TABLES

app = typer.Typer(help="Instances: models being served, and where.", no_args_is_help=True)
placement_app = typer.Typer(help="Try placements against the live cluster.", no_args_is_help=True)

Spec = Annotated[
    str | None,
    typer.Option(
        "--placement",
        metavar="SPEC",
        help='Manual placement (JSON, or @FILE), e.g. \'{"chat": {"devices": ["node-a:cpu"]}}\'.',
    ),
]
Replicas = Annotated[int, typer.Option(min=1, help="Copies of the model to serve.")]
Context = Annotated[
    int | None,
    typer.Option(
        "--context",
        min=1,
        help="Context length in tokens [default: 2048, or less; an embed or rerank"
        " instance's: 512].",
    ),
]
Slots = Annotated[
    int | None,
    typer.Option(
        "--slots",
        min=1,
        max=MAX_SLOTS,
        help="Tasks each replica serves at once, each with a KV cache of the whole context"
        " [default: as many as fit, up to 8].",
    ),
]
KvCache = Annotated[
    str,
    typer.Option(
        "--kv-cache",
        help="The KV cache's type: f16, q8_0 (about half the memory), q4_0 (about a quarter),"
        " or auto (f16, else the smallest that lets the context fit).",
    ),
]
SpeculativeOption = Annotated[
    str | None,
    typer.Option(
        "--speculative",
        help="Speculative decoding by prompt lookup: ngram, ngram:DRAFT_MAX, or the JSON object"
        ' POST /v1/instances takes ({"type": "ngram", "draft_max": 16, "ngram_min": 2,'
        ' "ngram_max": 4}). The same tokens, sooner where answers repeat their context.',
    ),
]


def parse_speculative(text: str) -> Speculative:
    """``--speculative``'s value; ``ValueError`` saying what it takes."""
    try:
        if text.lstrip().startswith("{"):
            return Speculative.model_validate_json(text)
        kind, _, draft = text.partition(":")
        if kind != "ngram":
            raise ValueError(f"{kind!r} is not a kind of speculative decoding (ngram is)")
        return (
            Speculative(type="ngram", draft_max=int(draft)) if draft else Speculative(type="ngram")
        )
    except ValidationError as exc:
        raise ValueError("; ".join(e["msg"] for e in exc.errors())) from None


Role = Annotated[
    InstanceRole | None,
    typer.Option(
        "--role",
        help="What it serves: chat (generation), embed (embeddings) or rerank (a reranker's"
        " relevance scores)"
        "; default: the placement's one role, else chat.",
    ),
]


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _read_spec(spec: str | None) -> str | None:
    """The spec text (``@FILE`` reads a file), checked for form before anything else."""
    if spec is None:
        return None
    if spec.startswith("@"):
        try:
            spec = Path(spec[1:]).read_text()
        except OSError as exc:
            _fail(f"cannot read the placement file: {exc}")
    try:
        parse_placement_spec(spec)
    except PlacementSpecError as exc:
        _fail(f"invalid placement: {exc}")
    return spec


async def _projection(db: str) -> ClusterState:
    engine = database.create_engine(db)
    try:
        if await database.current_revision(engine) is None:
            _fail(f"{db} holds no projection yet: is `shoal projector` running on it?")
        async with engine.connect() as conn:
            return await load_state(conn, PLANNING_TABLES)
    finally:
        await engine.dispose()


def _request(
    state: ClusterState,
    instance_id: str,
    model_id: str,
    replicas: int,
    context: int | None,
    spec: str | None,
    role: str | None,
    slots: int | None,
    kv_cache: str = DEFAULT_KV_CACHE,
    speculative: Speculative | None = None,
) -> PlacementRequest:
    try:
        return placement_request(
            state,
            instance_id=instance_id,
            model_id=model_id,
            spec=spec,
            role=role,
            replicas=replicas,
            context_length=context,
            slots=slots,
            kv_cache=kv_cache,
            speculative=speculative,
        )
    except RequestRefused as exc:
        _fail(exc.message)


def describe(result: Placement | Rejection, model_id: str) -> str:
    """A placement or a rejection, for people."""
    if isinstance(result, Rejection):
        return f"cannot be placed: {result.reason}"
    replicas = len({s.replica for s in result.shards})
    kv = f" KV cache {result.kv_cache}," if result.kv_cache != DEFAULT_KV_CACHE else ""
    lines = [
        f"{model_id}: {replicas} replica{'s' if replicas > 1 else ''}, context"
        f" {result.context_length} tokens, {result.slots} slot{'s' if result.slots > 1 else ''},"
        f"{kv}"
        f" {gib(result.need_bytes)} per replica"
    ]
    for i, s in enumerate(result.shards):
        lines.append(
            f"  replica {s.replica} rank {s.rank}/{s.world_size}  {s.node_id}:{s.device}"
            f"  layers {s.start_layer}-{s.end_layer - 1} ({s.end_layer - s.start_layer})"
            f"  {gib(result.shard_bytes[s.runner_id])}"
        )
        start = s.start_layer
        for part in s.devices:  # one runner across several devices of its node
            end = start + part.layers - 1
            lines.append(f"    {s.node_id}:{part.device}  layers {start}-{end} ({part.layers})")
            start = end + 1
        last = i + 1 == len(result.shards) or result.shards[i + 1].replica != s.replica
        if last and s.replica < len(result.why):
            lines.append(f"    why: {result.why[s.replica]}")
    return "\n".join(lines)


@placement_app.command()
def preview(
    model: Annotated[str, typer.Argument(help="Model id (see `shoal models list`).")],
    placement: Spec = None,
    replicas: Replicas = 1,
    context: Context = None,
    slots: Slots = None,
    kv_cache: KvCache = DEFAULT_KV_CACHE,
    role: Role = None,
    db: DbUrl = DEFAULT_DB,
) -> None:
    """Show where MODEL would be placed now (exit status 1 if it cannot be)."""
    spec = _read_spec(placement)
    state = asyncio.run(_projection(db))
    if state.model(model) is None and model not in builtin_cards():
        _fail(
            f"model {model!r} is neither known to the cluster nor in the catalogue (`shoal"
            " models list`): add it with `shoal models add`"
        )
    request = _request(state, "preview", model, replicas, context, spec, role, slots, kv_cache)
    result = place(cluster_view(state), request)
    typer.echo(describe(result, model))
    if isinstance(result, Rejection):
        raise typer.Exit(1)


@app.command()
def create(
    model: Annotated[str, typer.Argument(help="Model id; a built-in one is added if need be.")],
    placement: Spec = None,
    replicas: Replicas = 1,
    context: Context = None,
    slots: Slots = None,
    kv_cache: KvCache = DEFAULT_KV_CACHE,
    speculative: SpeculativeOption = None,
    role: Role = None,
    instance_id: Annotated[
        str | None, typer.Option("--id", help="Instance id [default: MODEL-<random>].")
    ] = None,
    queue: Annotated[
        bool,
        typer.Option(help="Request it even if it cannot be placed now (placed once it fits)."),
    ] = False,
    wait: Annotated[float, typer.Option(help="Seconds to wait for the decision; 0: don't.")] = 30,
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
) -> None:
    """Ask for MODEL to be served, and wait for the planner's decision."""
    spec = _read_spec(placement)
    if spec is not None and replicas != 1:
        _fail("give replicas in the placement spec, not with --replicas")
    iid = instance_id or f"{model}-{secrets.token_hex(3)}"
    try:
        drafts = parse_speculative(speculative) if speculative is not None else None
    except ValueError as exc:
        _fail(f"--speculative {speculative}: {exc}")

    async def main() -> Event | None:
        state = await _projection(db)
        nc = await connect(nats, name="shoal-instances")
        try:
            js = nc.jetstream()
            await ensure_streams(js, StreamSettings.from_env())
            if state.model(model) is None:
                if model not in builtin_cards():
                    _fail(
                        f"model {model!r} is not known to the cluster: add it with"
                        f" `shoal models add {model} --path FILE` (or --hf)"
                    )
                cache = default_data_dir() / "models"
                added, _, _ = await publish_model(
                    js, builtin_cards()[model], cache, served_from=worker_cache(cache)
                )
                typer.echo(f"added model {model}")
                state.commit(changes_for(state, added))
            ask = _request(
                state, iid, model, replicas, context, spec, role, slots, kv_cache, drafts
            )
            result = place(cluster_view(state), ask)
            if isinstance(result, Rejection) and not queue:
                _fail(f"{model} {describe(result, model)} (--queue requests it anyway)")
            requested = InstanceRequested(
                instance_id=iid,
                model_id=model,
                origin=f"shoal-cli@{socket.gethostname()}",
                placement=spec,
                replicas=replicas,
                context_length=context,
                role=ask.role,
                slots=slots,
                kv_cache=ask.kv_cache,
                speculative=drafts,
            )
            outcomes = (InstancePlaced, PlacementRejected)
            return await _publish_and_wait(nc, requested, wait, outcomes)
        finally:
            await nc.close()

    outcome = asyncio.run(main())
    typer.echo(f"requested {iid}")
    if isinstance(outcome, InstancePlaced):
        shards = ", ".join(
            f"{s.node_id}:{s.device}[{s.start_layer}:{s.end_layer}]" for s in outcome.shards
        )
        n = outcome.slots or 1
        typer.echo(
            f"placed {iid} on {shards}, {n} slot{'s' if n > 1 else ''} each,"
            f" KV cache {outcome.kv_cache}"
        )
    elif isinstance(outcome, PlacementRejected):
        _fail(f"{iid} rejected: {outcome.reason}")
    elif wait > 0:
        typer.echo(f"no decision within {wait:g} s: is `shoal planner` running?", err=True)


@app.command()
def delete(
    instance_id: Annotated[str, typer.Argument(metavar="ID")],
    wait: Annotated[float, typer.Option(help="Seconds to wait for the deletion; 0: don't.")] = 30,
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
) -> None:
    """Stop serving instance ID."""

    async def main() -> Event | None:
        inst = (await _projection(db)).instance(instance_id)
        if inst is None:
            _fail(f"no instance {instance_id!r} (see `shoal instances list`)")
        if inst.status == "deleted":
            _fail(f"instance {instance_id!r} is already deleted")
        nc = await connect(nats, name="shoal-instances")
        try:
            request = InstanceDeleteRequested(
                instance_id=instance_id,
                origin=f"shoal-cli@{socket.gethostname()}",
                reason="deleted with `shoal instances delete`",
            )
            return await _publish_and_wait(nc, request, wait, (InstanceDeleted,))
        finally:
            await nc.close()

    outcome = asyncio.run(main())
    if outcome is not None:
        typer.echo(f"deleted {instance_id}")
    else:
        typer.echo(f"delete of {instance_id} requested")


async def _publish_and_wait(
    nc: Client,
    request: InstanceRequested | InstanceDeleteRequested,
    wait: float,
    outcomes: tuple[type[Any], ...],
) -> Event | None:
    """Publish ``request`` and return the first event of ``outcomes`` for its instance, or
    None after ``wait`` seconds. Subscribed before publishing, so no answer is missed."""
    got: asyncio.Queue[Event] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        with contextlib.suppress(ValueError):  # not an event: not an answer either
            got.put_nowait(parse_event(msg.data))

    sub = await nc.subscribe(aggregate_filter("instance", request.instance_id), cb=on_msg)
    try:
        await Publisher(nc.jetstream()).publish(request)
        if wait <= 0:
            return None
        async with asyncio.timeout(wait):
            while True:
                event = await got.get()
                if type(event) in outcomes:
                    return event
    except TimeoutError:
        return None
    finally:
        await sub.unsubscribe()


def shard_state(state: str, progress: float | None) -> str:
    """A runner's state as the list shows it: with how far it got while it downloads or loads
    its weights (a model loaded on demand answers its first request once that is done)."""
    if progress is None or state not in STARTING:
        return state
    return f"{state} {progress:.0%}"


@app.command("list")
def list_instances(
    db: DbUrl = DEFAULT_DB,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per instance.")] = False,
    all_: Annotated[bool, typer.Option("--all", help="Include deleted instances.")] = False,
) -> None:
    """Instances, where their shards run, and in what state."""
    state = asyncio.run(_projection(db))
    rows: list[dict[str, Any]] = []
    for inst in sorted(state.instances(), key=lambda i: (str(i.requested_at), i.instance_id)):
        if inst.status == "deleted" and not all_:
            continue
        runners = sorted(state.runners_of(inst.instance_id), key=lambda r: (r.replica, r.rank))
        rows.append(
            {
                "instance_id": inst.instance_id,
                "model_id": inst.model_id,
                "role": inst.role,
                "status": inst.status,
                "replicas": inst.replicas,
                "slots": inst.slots,
                "kv_cache": inst.kv_cache,
                "speculative": inst.speculative,
                "generation": inst.generation,
                "reason": inst.reason,
                "shards": [
                    {
                        "runner_id": r.runner_id,
                        "node": r.node_id,
                        "device": r.device,
                        "replica": r.replica,
                        "rank": r.rank,
                        "layers": [r.start_layer, r.end_layer],
                        "state": r.state,
                        "progress": r.progress,
                        "slots": r.slots,
                    }
                    for r in runners
                ],
            }
        )
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("id", "model", "role", "status", "replicas", "slots", "shards", "reason"):
        table.add_column(column)
    for row in rows:
        shards = "\n".join(
            f"{s['node']}:{s['device']} [{s['layers'][0]}:{s['layers'][1]}]"
            f" {shard_state(s['state'], s['progress'])}"
            for s in row["shards"]
        )
        table.add_row(
            row["instance_id"],
            row["model_id"],
            row["role"],
            row["status"],
            str(row["replicas"]),
            str(row["slots"] or "-"),
            shards or "-",
            row["reason"] or "",
        )
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
    if not rows:
        typer.echo("(no instances; `shoal instances create MODEL` asks for one)")
