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
from rich.console import Console
from rich.table import Table

from bus.connection import connect
from bus.events import ModelAdded
from bus.streams import MODELS_BUCKET, StreamSettings, ensure_streams
from services.cli.options import DEFAULT_NATS, NatsUrl, default_data_dir
from services.models.cards import (
    ENGINES,
    Engine,
    HfSource,
    ModelCard,
    PathSource,
    UnknownModel,
    builtin_cards,
    card_for,
)

# services.models.metadata and .resolve are imported inside the commands: they pull in gguf
# (numpy) and huggingface_hub, whose import every other `shoal` command would pay.

app = typer.Typer(help="Model cards, and adding models to the cluster.", no_args_is_help=True)

CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="Where downloaded and assembled weights go [default: DATA_DIR/models].",
        show_default=False,
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
    cache_dir: CacheDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per card.")] = False,
) -> None:
    """The built-in model cards, with layers, context and size read from local weights."""
    from services.models.metadata import GgufError, model_facts
    from services.models.resolve import local_path

    rows: list[dict[str, Any]] = []
    for card in builtin_cards().values():
        path = local_path(card, _cache_dir(cache_dir))
        row: dict[str, Any] = {
            "id": card.id,
            "family": card.family,
            "engines": list(card.engines),
            "chat_format": card.chat_format,
            "source": card.source.label(),
            "path": str(path) if path else None,
            "n_layers": None,
            "context_length": None,
            "size_bytes": None,
        }
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
                }
        rows.append(row)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("id", "family", "layers", "context", "size", "engines", "chat", "source"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["id"],
            row["family"],
            str(row["n_layers"] or "-"),
            str(row["context_length"] or "-"),
            _size(row["size_bytes"]),
            ",".join(row["engines"]),
            row["chat_format"] or "(gguf)",
            row["source"],
        )
    # Piped output gets room for the whole source column rather than rich's default 80.
    Console(highlight=False, width=None if sys.stdout.isatty() else 160).print(table)
    if any(row["path"] is None for row in rows):
        typer.echo("('-': weights not on this machine yet; `shoal models add ID` fetches them)")


@app.command()
def add(
    model_id: Annotated[str, typer.Argument(metavar="ID", help="The model's id in the cluster.")],
    path: Annotated[
        Path | None,
        typer.Option("--path", help="A GGUF file (llamacpp) or an MLX model directory."),
    ] = None,
    hf: Annotated[
        str | None, typer.Option("--hf", metavar="REPO", help="Hugging Face repository id.")
    ] = None,
    file: Annotated[
        str | None, typer.Option("--file", metavar="FILENAME", help="The file in --hf REPO.")
    ] = None,
    revision: Annotated[str | None, typer.Option(help="Revision in --hf REPO.")] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            metavar="llamacpp|mlx",
            help="Engine that runs it [default: mlx for a directory, else llamacpp].",
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
    nats: NatsUrl = DEFAULT_NATS,
    cache_dir: CacheDir = None,
) -> None:
    """Make a model known to the cluster: its weights go into the models bucket, from which
    every node that runs a shard of it fetches them (publishes ModelAdded).

    With neither --path nor --hf, ID must be a catalogue card (see `shoal models list`)."""
    from services.models.metadata import GgufError
    from services.models.resolve import ModelUnavailable
    from services.models.shared import WeightsUnavailable

    if path is not None and hf is not None:
        _fail("give --path or --hf, not both")
    if (hf is None) != (file is None):
        _fail("--hf REPO needs --file FILENAME (and --file goes with --hf)")
    if engine is not None and engine not in ENGINES:
        _fail(f"unknown engine {engine!r}: choose from {', '.join(ENGINES)}")
    if node is not None and not local:
        _fail("--node goes with --local (a shared model is served by any node)")
    local_node = _local_node(node) if local else None
    try:
        card = _card(model_id, path, hf, file, revision, engine, chat_format, family)
    except UnknownModel as exc:
        _fail(str(exc))

    async def main() -> tuple[ModelAdded, Path, int]:
        # NATS first: an unreachable server is found out before a long download, not after.
        nc = await connect(nats, name="shoal-models-add")
        try:
            js = nc.jetstream()
            await ensure_streams(js, StreamSettings.from_env())
            return await publish_model(js, card, _cache_dir(cache_dir), local_node=local_node)
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
    if event.node_id is not None:
        typer.echo(f"  weights: {weights}, served by node {event.node_id} only")
    else:
        names = ", ".join(f.name for f in event.files)
        typer.echo(f"  weights: {names} in {MODELS_BUCKET} (from {weights})")


def _local_node(node: str | None) -> str:
    """The node a --local model is kept on: the one given, else this machine's worker."""
    from services.worker.identity import stored_node_id

    if node:
        return node
    # `shoal up` keeps its worker's data in <data dir>/worker.
    for data_dir in (default_data_dir() / "worker", default_data_dir()):
        if found := stored_node_id(data_dir):
            return found
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
) -> tuple[ModelAdded, Path, int]:
    """``services.models.add.add_model``, showing progress: ``on_progress`` gets the fetch's
    fractions and then the store's (from another thread); by default whole percents of each
    are printed. Returns the event, the weights' path and the event's stream sequence."""
    from services.models.add import add_model

    return await add_model(
        js, card, cache_dir, local_node=local_node,
        on_fetch=on_progress or _progress_printer("fetching weights"),
        on_store=on_progress or _progress_printer(f"storing in {MODELS_BUCKET}"),
    )  # fmt: skip


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
    else:
        assert hf is not None and file is not None
        source = HfSource(repo=hf, filename=file, revision=revision)
        default_engine = "llamacpp"
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
