"""`shoal models ...`: the built-in model cards, and making a model known to the cluster."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from nats.js import JetStreamContext
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from sqlalchemy import make_url
from sqlalchemy.exc import DBAPIError

from bus.connection import connect
from bus.streams import MODELS_BUCKET, StreamSettings, ensure_streams
from cli.options import (
    DEFAULT_DB,
    DEFAULT_NATS,
    DbUrl,
    NatsUrl,
    absolute,
)
from events.catalogue import ModelAdded
from events.kinds import ENGINES, Engine
from projectors.state import ClusterState
from services.models.cards import HfSource, ModelCard, PathSource
from services.models.catalogue import UnknownModel, builtin_cards, card_for
from services.models.weights_cache import WeightsCache
from services.paths import default_data_dir

# services.models.metadata and .resolve are imported inside the commands: they pull in gguf
# (numpy) and huggingface_hub, whose import every other `shoal` command would pay.

app = typer.Typer(help="Model cards, and adding models to the cluster.", no_args_is_help=True)

CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="Where downloaded and assembled weights go [default: DATA_DIR/models].",
        show_default=False,
        callback=absolute,
    ),
]


def _cache_dir(value: Path | None) -> Path:
    # The worker keeps models in <data dir>/models too, so what the CLI fetches, it finds.
    return value if value is not None else default_data_dir() / "models"


def _fail(message: str) -> NoReturn:
    """A user error: one line on stderr, exit status 1, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.0f} MiB"


@app.command("list")
def list_models(
    match: Annotated[
        str | None, typer.Argument(metavar="[TEXT]", help="Only cards whose id or family has it.")
    ] = None,
    cache_dir: CacheDir = None,
    db: DbUrl = DEFAULT_DB,
    hub: Annotated[
        bool,
        typer.Option(
            "--hub",
            help="Read each GGUF card's numbers from its file's header on the Hub (HTTP range"
            " requests, no download) rather than the card's estimate.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per card.")] = False,
) -> None:
    """The catalogue's model cards: layers, context and size (read from the weights when they
    are on this machine, else the card's estimate), and whether each fits the cluster now."""
    from services.models.metadata import GgufError, model_facts
    from services.models.resolve import local_path

    if hub:
        from huggingface_hub import constants as hf_constants

        from services.models.resolve import unreachable

        why = "HF_HUB_OFFLINE is set" if hf_constants.HF_HUB_OFFLINE else None
        if why := why or unreachable(hf_constants.ENDPOINT):
            _fail(f"--hub: cannot reach the Hugging Face Hub ({why})")
    state = asyncio.run(_cluster_state(db)) if _has_projection(db) else None
    rows: list[dict[str, Any]] = []
    for card in builtin_cards().values():
        if match and match.lower() not in f"{card.id} {card.family}".lower():
            continue
        path = local_path(card, _cache_dir(cache_dir))
        header_error = None
        if hub and path is None and card.engines == ["llamacpp"]:
            card, header_error = _with_hub_numbers(card)
        hub_numbers = hub and path is None and header_error is None and card.engines == ["llamacpp"]
        estimate = card.estimate
        row: dict[str, Any] = {
            "id": card.id,
            "family": card.family,
            "variant": card.variant,
            "engines": list(card.engines),
            "chat_format": card.chat_format,
            "tool_calls": card.tool_calls,
            "source": card.source.label(),
            "vision": card.projector is not None or card.vision,
            "path": str(path) if path else None,
            "n_layers": estimate.n_layers if estimate else None,
            "context_length": estimate.context_length if estimate else None,
            "size_bytes": estimate.size_bytes if estimate else None,
            "estimated": estimate is not None and not hub_numbers,
            "in_cluster": state is not None and state.model(card.id) is not None,
            "fits": None,
            "placement": None,
        }
        if header_error is not None:
            row["error"] = header_error
        if path is not None:
            try:
                facts = model_facts(path, card.engines[0])
            except GgufError as exc:
                row["error"] = str(exc)
            else:
                row |= {
                    "n_layers": facts.n_layers,
                    "context_length": facts.context_length,
                    "size_bytes": facts.size_bytes,
                    "estimated": False,
                }
        if state is not None:
            row["fits"], row["placement"] = _fits(state, card)
        rows.append(row)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table(box=None, pad_edge=False)
    columns = ("id", "layers", "context", "size", "engine", "chat", "tools", "vision", "fits now")
    for column in columns:
        table.add_column(column)
    for row in rows:
        fits = "?" if row["fits"] is None else (row["placement"] if row["fits"] else "no")
        table.add_row(
            row["id"] + (" *" if row["in_cluster"] else ""),
            str(row["n_layers"] or "-"),
            str(row["context_length"] or "-"),
            ("~" if row["estimated"] else "") + _size(row["size_bytes"]),
            ",".join(row["engines"]),
            row["chat_format"] or ("(template)" if row["engines"] == ["mlx"] else "(gguf)"),
            row["tool_calls"] or "-",
            "images" if row["vision"] else "-",
            fits,
        )
    # Piped output gets room for every column rather than rich's default 80.
    Console(highlight=False, width=None if sys.stdout.isatty() else 160).print(table)
    typer.echo(
        "(~: the card's estimate (--hub reads the GGUF's header instead), the weights are not"
        " on this machine; *: known to the cluster; vision: it reads images, with its projector"
        " file or, on MLX, its vision tower; `shoal models add ID` adds one, and so does a"
        " request for an instance)"
    )
    if state is None:
        typer.echo(f"(fits now ?: no projection at {db}; give --db)")


def _has_projection(db: str) -> bool:
    """False for a SQLite file that does not exist: reading it would create it."""
    url = make_url(db)
    return not url.drivername.startswith("sqlite") or bool(
        url.database and Path(url.database).exists()
    )


async def _cluster_state(db: str) -> ClusterState | None:
    """The projection, or None when there is none to read (nothing is created)."""
    from projectors import database
    from projectors.store import load_state
    from services.planner.planner import PLANNING_TABLES

    engine = database.create_engine(db)
    try:
        if await database.current_revision(engine) is None:
            return None
        async with engine.connect() as conn:
            return await load_state(conn, PLANNING_TABLES)
    except (OSError, DBAPIError):
        return None
    finally:
        await engine.dispose()


def _with_hub_numbers(card: ModelCard) -> tuple[ModelCard, str | None]:
    """The card with its GGUF header's numbers, read on the Hub; or as it is, and why not."""
    from huggingface_hub import get_token

    from services.models.remote_header import RemoteHeaderError, hub_estimate

    try:
        return card.model_copy(update={"estimate": hub_estimate(card, get_token())}), None
    except RemoteHeaderError as exc:
        return card, str(exc)


def _fits(state: ClusterState, card: ModelCard) -> tuple[bool, str]:
    from services.planner.card_fit import fits_now

    return fits_now(state, card)


@app.command()
def add(
    model_id: Annotated[str, typer.Argument(metavar="ID", help="The model's id in the cluster.")],
    path: Annotated[
        Path | None,
        typer.Option(
            "--path", help="A GGUF file (llamacpp) or an MLX model directory.", callback=absolute
        ),
    ] = None,
    hf: Annotated[
        str | None, typer.Option("--hf", metavar="REPO", help="Hugging Face repository id.")
    ] = None,
    file: Annotated[
        str | None,
        typer.Option(
            "--file",
            metavar="FILENAME",
            help="The GGUF file in --hf REPO (a split one's first part); without it, the whole"
            " repository (an MLX model).",
        ),
    ] = None,
    revision: Annotated[str | None, typer.Option(help="Revision in --hf REPO.")] = None,
    mmproj: Annotated[
        str | None,
        typer.Option(
            "--mmproj",
            metavar="FILE",
            help="The model's multimodal projector (an mmproj GGUF), with which it reads images:"
            " a file on this machine, or with --hf, a file of REPO [default: a card's own].",
            show_default=False,
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            metavar="llamacpp|mlx|diffusers",
            help="Engine that runs it [default: diffusers for a directory with a"
            " model_index.json, mlx for another directory, else llamacpp].",
            show_default=False,
        ),
    ] = None,
    chat_format: Annotated[
        str | None,
        typer.Option(help="llama-cpp-python chat format [default: the GGUF's chat template]."),
    ] = None,
    family: Annotated[str | None, typer.Option(help="Model family, e.g. 'qwen2'.")] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Keep the weights where they are instead of storing them in the models bucket:"
            " only this machine's node (--node) serves the model.",
        ),
    ] = False,
    node: Annotated[
        str | None,
        typer.Option(
            metavar="NODE",
            help="With --local: the node whose disk has the weights [default: the worker of"
            " this machine's data dir].",
            show_default=False,
        ),
    ] = None,
    bucket: Annotated[
        bool,
        typer.Option(
            "--bucket",
            help="Store a copy of the weights in the models bucket even where this machine's"
            " worker could serve them: for a machine that will not stay on.",
        ),
    ] = False,
    nats: NatsUrl = DEFAULT_NATS,
    cache_dir: CacheDir = None,
) -> None:
    """Make a model known to the cluster (publishes ModelAdded): this machine's worker serves its
    weights to every node that runs a shard of it; where no worker has run, or with --bucket,
    they are stored in the models bucket instead.

    With neither --path nor --hf, ID must be a catalogue card (see `shoal models list`)."""
    from services.models.metadata import GgufError
    from services.models.resolve import ModelUnavailable
    from services.models.shared import WeightsUnavailable

    if path is not None and hf is not None:
        _fail("give --path or --hf, not both")
    if file is not None and hf is None:
        _fail("--file goes with --hf REPO")
    if hf is not None and file is None and engine == "llamacpp":
        _fail("--hf REPO for llamacpp needs --file FILENAME (a GGUF file of the repository)")
    if engine is not None and engine not in ENGINES:
        _fail(f"unknown engine {engine!r}: choose from {', '.join(ENGINES)}")
    if mmproj is not None and engine == "mlx":
        _fail(
            "--mmproj is a llama.cpp projector: an MLX vision model holds its vision tower in"
            " its own weights (mlx-vlm's layout), which Shoal finds there"
        )
    if node is not None and not local:
        _fail("--node goes with --local (a shared model is served by any node)")
    if bucket and local:
        _fail("--bucket and --local contradict each other: a --local model stays on its node")
    local_node = _local_node(node) if local else None
    cache = _cache_dir(cache_dir)
    # A --local model's weights stay where they are; its projector goes in the worker's cache.
    served_from = None if bucket else worker_cache(cache)
    try:
        card = _card(model_id, path, hf, file, revision, engine, chat_format, family)
        if mmproj is not None:
            card = card.model_copy(update={"projector": _projector(mmproj, hf, revision)})
            ModelCard.model_validate(card.model_dump())  # an MLX model refuses one
    except UnknownModel as exc:
        _fail(str(exc))
    except ValidationError as exc:
        _fail(exc.errors()[0]["msg"].removeprefix("Value error, "))

    async def main() -> tuple[ModelAdded, Path, int]:
        # NATS first: an unreachable server is found out before a long download, not after.
        nc = await connect(nats, name="shoal-models-add")
        try:
            js = nc.jetstream()
            await ensure_streams(js, StreamSettings.from_env())
            return await publish_model(
                js, card, cache, local_node=local_node, served_from=served_from
            )
        finally:
            await nc.close()

    try:
        event, weights, seq = asyncio.run(main())
    except (ModelUnavailable, GgufError, WeightsUnavailable) as exc:
        _fail(str(exc))
    typer.echo(
        f"added {event.model_id}: {event.n_layers} layers, context {event.context_length},"
        f" {_size(event.size_bytes)}, engines {','.join(event.engines)} (seq {seq})"
    )
    names = ", ".join(f.name for f in event.files if not f.projector)
    projector = next((f for f in event.files if f.projector), None)
    if projector is not None:
        typer.echo(f"  projector: {projector.name} ({_size(projector.size)}): it reads images")
    if event.node_id is not None:
        typer.echo(f"  weights: {weights}, served by node {event.node_id} only")
    elif served_from is not None:
        typer.echo(
            f"  weights: {names} from {weights}, given to other nodes by this machine's"
            " worker (no copy in the bucket; --bucket stores one)"
        )
    else:
        typer.echo(f"  weights: {names} in {MODELS_BUCKET} (from {weights})")


@app.command()
def remove(
    model_id: Annotated[str, typer.Argument(metavar="ID", help="The model's id in the cluster.")],
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
) -> None:
    """Make the cluster forget a model that no live instance uses (publishes ModelRemoved): the
    objects of the models bucket that no other model names are deleted, and each node drops
    its files from its cache. It can be added again."""
    from services.models.remove import ModelInUse, ModelNotKnown, Removal, remove_model

    if not _has_projection(db):
        _fail(f"no projection at {db}: give --db (the projector's database)")

    async def main() -> Removal:
        state = await _cluster_state(db)
        if state is None:
            _fail(f"{db} holds no projection yet: is `shoal projector` running on it?")
        nc = await connect(nats, name="shoal-models-remove")
        try:
            return await remove_model(
                nc.jetstream(), state, model_id, reason="removed with `shoal models remove`"
            )
        finally:
            await nc.close()

    try:
        removal = asyncio.run(main())
    except ModelNotKnown:
        _fail(f"the cluster knows no model {model_id!r} (see `shoal state`)")
    except ModelInUse as exc:
        _fail(
            f"model {model_id!r} is used by live instance(s) {', '.join(exc.instances)}:"
            " delete them first (`shoal instances delete ID`)"
        )
    freed = sum(f.size for f in removal.deleted)
    typer.echo(f"removed {model_id} (seq {removal.seq})")
    if removal.deleted:
        typer.echo(
            f"  deleted {len(removal.deleted)} object(s) from {MODELS_BUCKET} ({_size(freed)})"
        )
    if removal.kept:
        typer.echo(f"  kept {len(removal.kept)} object(s) another model names")


def _worker_dir(*candidates: Path) -> tuple[Path, str] | None:
    """The data dir of the first of ``candidates`` (then the default data dir's: `shoal up`
    keeps its worker's data in <data dir>/worker) where a worker has run, and its node id."""
    from services.worker.identity import stored_node_id

    for data_dir in (*candidates, default_data_dir() / "worker", default_data_dir()):
        if found := stored_node_id(data_dir):
            return data_dir, found
    return None


def worker_cache(cache_dir: Path) -> WeightsCache | None:
    """The cache of this machine's worker, which serves what is added from here to other nodes:
    the worker whose data dir holds ``cache_dir`` (a worker keeps <data dir>/models), or the
    worker of the `shoal up` whose data dir does (<data dir>/worker), else the default data
    dir's; None where no worker has run on this machine."""
    found = _worker_dir(cache_dir.parent, cache_dir.parent / "worker")
    return WeightsCache(found[0] / "models") if found is not None else None


def _local_node(node: str | None) -> str:
    """The node a --local model is kept on: the one given, else this machine's worker."""
    if node:
        return node
    if found := _worker_dir():
        return found[1]
    _fail(
        "--local: no worker has run with this machine's data dir"
        f" ({default_data_dir() / 'worker'}): give --node NODE (see `shoal state`)"
    )


async def publish_model(
    js: JetStreamContext,
    card: ModelCard,
    cache_dir: Path,
    on_progress: Callable[[float], None] | None = None,
    *,
    local_node: str | None = None,
    on_store: Callable[[float], None] | None = None,
    served_from: WeightsCache | None = None,
) -> tuple[ModelAdded, Path, int]:
    """``services.models.add.add_model``, showing progress: ``on_progress`` gets the fetch's
    fractions (from another thread), ``on_store`` the store's (``on_progress`` too when not
    given); by default whole percents of each are printed. Returns the event, the weights'
    path and the event's stream sequence."""
    from services.models.add import add_model

    return await add_model(
        js,
        card,
        cache_dir,
        local_node=local_node,
        served_from=served_from,
        on_fetch=on_progress or _progress_printer("fetching weights"),
        on_store=on_store or on_progress or _progress_printer(f"storing in {MODELS_BUCKET}"),
    )


def _card(
    model_id: str,
    path: Path | None,
    hf: str | None,
    file: str | None,
    revision: str | None,
    engine: Engine | None,
    chat_format: str | None,
    family: str | None,
) -> ModelCard:
    builtin = builtin_cards().get(model_id)
    if path is None and hf is None:
        card = card_for(model_id)  # UnknownModel lists the built-in ids
        updates: dict[str, Any] = {}
        if chat_format is not None:
            updates["chat_format"] = chat_format
        if family is not None:
            updates["family"] = family
        if engine is not None:
            updates["engines"] = [engine]
        return card.model_copy(update=updates) if updates else card
    if path is not None:
        resolved = path.expanduser().absolute()
        source: PathSource | HfSource = PathSource(path=str(resolved))
        default_engine: Engine = "mlx" if resolved.is_dir() else "llamacpp"
        if (resolved / "model_index.json").is_file():  # a diffusers pipeline: an image model
            default_engine = "diffusers"
    else:
        assert hf is not None
        # Without a file, the whole repository: an MLX model.
        source = HfSource(repo=hf, filename=file, revision=revision)
        default_engine = "llamacpp" if file is not None else "mlx"
    engines: list[Engine] = [engine or default_engine]
    # Adding a built-in model from a local copy keeps what its card knows (family, chat format).
    return ModelCard(
        id=model_id,
        family=family if family is not None else (builtin.family if builtin else ""),
        engines=engines,
        chat_format=chat_format
        if chat_format is not None
        else (builtin.chat_format if builtin else None),
        source=source,
    )


def _projector(given: str, hf: str | None, revision: str | None) -> HfSource | PathSource:
    """Where ``--mmproj`` says the projector is: a file of the --hf repository, or here."""
    if hf is not None and not Path(given).expanduser().is_file():
        return HfSource(repo=hf, filename=given, revision=revision)
    return PathSource(path=str(Path(given).expanduser().absolute()))


def _progress_printer(what: str) -> Callable[[float], None]:
    """Prints each new whole percent; resolve_model already calls it at most once a second."""
    shown: list[int] = []

    def show(fraction: float) -> None:
        if not shown and fraction >= 1.0:
            return  # already on disk: nothing was fetched, so no progress to speak of
        percent = int(fraction * 100)
        if not shown or shown[-1] != percent:
            shown.append(percent)
            print(f"{what}: {percent}%", file=sys.stderr, flush=True)

    return show


@app.command()
def search(
    text: Annotated[str, typer.Argument(help="What to look for, e.g. 'qwen3 8b'.")],
    mlx: Annotated[bool, typer.Option("--mlx", help="MLX conversions, not GGUF files.")] = False,
    limit: Annotated[int, typer.Option(min=1, max=200, help="At most this many.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per model.")] = False,
) -> None:
    """Search the Hugging Face Hub for models with GGUF files (or MLX conversions), most
    downloaded first. Needs the network; add what you find with `shoal models add`."""
    from services.models.hub_search import HubUnavailable, search_hub

    try:
        found = search_hub(text, mlx=mlx, limit=limit)
    except HubUnavailable as exc:
        _fail(str(exc))
    if as_json:
        for model in found:
            typer.echo(model.model_dump_json())
        return
    if not found:
        typer.echo(f"no {'MLX' if mlx else 'GGUF'} models on the Hub match {text!r}")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("repository", "downloads", "likes", "add it with"):
        table.add_column(column)
    for model in found:
        table.add_row(model.repo, str(model.downloads), str(model.likes), model.add_command())
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
