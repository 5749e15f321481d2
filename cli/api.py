"""`shoal api`: the HTTP API (OpenAI-compatible endpoints and cluster control)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from api.app import create_app
from api.config import (
    DEFAULT_BODY_TIMEOUT_S,
    ApiConfig,
    OnDemandRoles,
    keys_from_env,
    parse_aliases,
)
from api.http_protocol import bounded_httptools, connection_limit
from api.model_defaults import ModelDefaults, ModelDefaultsError, parse_model_defaults
from bus.embedded import port_in_use
from bus.leaderless import RETRY_FOR_S
from bus.streams import parse_size
from cli.exposure import refuse_exposure
from cli.options import (
    DEFAULT_DB,
    DEFAULT_NATS,
    DbUrl,
    NatsUrl,
    absolute,
    run_until_signal,
    setup_logging,
)

Host = Annotated[str, typer.Option(help="Address the API listens on.")]
Port = Annotated[int, typer.Option(help="Port the API listens on.")]
TlsCert = Annotated[
    Path | None,
    typer.Option(
        "--tls-cert",
        envvar="SHOAL_API_TLS_CERT",
        exists=True,
        dir_okay=False,
        callback=absolute,
        help="Serve HTTPS with this certificate (PEM; with --tls-key).",
    ),
]
TlsKey = Annotated[
    Path | None,
    typer.Option(
        "--tls-key",
        envvar="SHOAL_API_TLS_KEY",
        exists=True,
        dir_okay=False,
        callback=absolute,
        help="The key of --tls-cert (PEM).",
    ),
]
Aliases = Annotated[
    list[str] | None,
    typer.Option(
        "--alias",
        help="NAME=MODEL: clients may call MODEL by NAME (repeatable; or"
        " SHOAL_MODEL_ALIASES), e.g. the model names an SDK sends.",
    ),
]
CorsOrigins = Annotated[
    list[str] | None,
    typer.Option(
        "--cors-origin",
        help="An origin whose browser pages may call the API"
        " (repeatable; '*' for any, without credentials). None by default.",
    ),
]
MaxQueued = Annotated[
    int | None,
    typer.Option(
        "--max-queued",
        min=0,
        help="Requests that may wait in the API for a busy"
        " model (per model); past it, a 429 with Retry-After [default: 16 per slot of"
        " the model's runners].",
    ),
]
ApiKeys = Annotated[
    list[str] | None,
    typer.Option(
        "--api-key",
        help="A key clients must send as a Bearer token (repeatable). Other users of the"
        " machine see it in the process list: prefer --api-key-file or SHOAL_API_KEYS."
        " Without any key, the API is open.",
    ),
]
ApiKeyFiles = Annotated[
    list[Path] | None,
    typer.Option(
        "--api-key-file",
        exists=True,
        dir_okay=False,
        help="A file of keys clients must send as Bearer tokens, one a line (repeatable; keep"
        " it readable by you alone).",
    ),
]
SECRET_IN_ARGV = (
    "warning: {option} puts a secret in this process's command line, which every user of the"
    " machine can read (ps): use {instead}"
)


def api_keys(given: list[str] | None, files: list[Path] | None) -> frozenset[str]:
    """The API's keys: ``--api-key`` (with a warning: argv is public), ``--api-key-file``
    and ``SHOAL_API_KEYS``."""
    if given:
        typer.echo(
            SECRET_IN_ARGV.format(option="--api-key", instead="--api-key-file or SHOAL_API_KEYS"),
            err=True,
        )
    from_files = frozenset[str]()
    for path in files or ():
        try:
            from_files |= keys_from_env(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            typer.echo(f"error: --api-key-file {path}: {exc}", err=True)
            raise typer.Exit(1) from None
    return frozenset(given or ()) | from_files | keys_from_env()


def refuse_wildcards(
    keys: frozenset[str], allowed_hosts: list[str] | None, cors_origins: list[str] | None
) -> str | None:
    """Why an API without keys must not answer any host or any origin, or None: every web
    page the machine's browser opens could then call it (DNS rebinding, as Ollama's
    CVE-2024-28224)."""
    if keys:
        return None
    wild = [
        option
        for option, values in (("--allowed-host", allowed_hosts), ("--cors-origin", cors_origins))
        if "*" in (values or ())
    ]
    if not wild:
        return None
    return (
        f"refusing {' and '.join(f'{o} *' for o in wild)} without API keys: any web page could"
        " then call this API. Name the hosts and origins, or give keys (--api-key-file or"
        " SHOAL_API_KEYS)"
    )


MaxBody = Annotated[
    str,
    typer.Option(
        "--max-body",
        help="The largest request body accepted (e.g. 32M, 1G); a larger one is refused with"
        " a 413 before it is read.",
    ),
]
BodyTimeout = Annotated[
    float,
    typer.Option(
        "--body-timeout",
        min=0.1,
        help="Seconds a client may take to send a request's body; past them, a 408.",
    ),
]
AllowedHosts = Annotated[
    list[str] | None,
    typer.Option(
        "--allowed-host",
        help="A name or address clients reach the API by (its Host header), besides"
        " localhost, loopback addresses, --host and, beyond loopback, this machine's names"
        " and addresses (repeatable; '*' for any). Other names are refused (DNS rebinding).",
    ),
]
LogWait = Annotated[
    float,
    typer.Option(
        "--log-wait",
        min=0.0,
        help="Seconds a request waits for the log (NATS JetStream) to store its task while"
        " the log has no leader or quorum; past them, a 503 log_unavailable.",
    ),
]
LoadOnDemand = Annotated[
    bool,
    typer.Option(
        "--load-on-demand/--no-load-on-demand",
        help="A request for a model the cluster knows that nothing serves loads it (and waits"
        " for it); without: a 503 saying no instance serves it.",
    ),
]
OnDemand = Annotated[
    str,
    typer.Option(
        "--on-demand",
        metavar="users|admins",
        help="Which keys may change what the cluster holds through a request: unload a model"
        " (Ollama's keep_alive 0), pin one (keep_alive -1), or download one not on its disks"
        " yet. admins (the default): a user key's such request is a 403 saying an admin must;"
        " users: any key.",
    ),
]


def on_demand_roles(text: str) -> OnDemandRoles:
    """``--on-demand``: users or admins."""
    if text == "users":
        return "users"
    if text == "admins":
        return "admins"
    typer.echo(f"error: --on-demand is users or admins, not {text!r}", err=True)
    raise typer.Exit(2)


ReasoningBudget = Annotated[
    int,
    typer.Option(
        "--reasoning-budget",
        min=-1,
        help="The most tokens a thinking model thinks when the request sets no budget (as"
        " llama-server's --reasoning-budget); once spent, the runner ends the thinking and the"
        " answer follows. -1: unbounded.",
    ),
]
MaxTokens = Annotated[
    int,
    typer.Option(
        "--max-tokens",
        min=-1,
        help="The most tokens an answer has when its request sets no limit (as llama-server's"
        " --n-predict, Ollama's num_predict); a model's --model-defaults max_tokens wins. The"
        " answer is cut as by the request's own limit. -1: until the context is full.",
    ),
]
ModelDefaultsFile = Annotated[
    Path | None,
    typer.Option(
        "--model-defaults",
        envvar="SHOAL_MODEL_DEFAULTS",
        metavar="PATH",
        exists=True,
        dir_okay=False,
        callback=absolute,
        help="A JSON file of per-model defaults for models loaded on demand, keyed by the name"
        ' clients ask for (an alias too): {"qwen3-8b": {"keep_alive": "30m", "context_length":'
        ' 8192}, "smollm2-135m": {"pinned": true}}. Keys: keep_alive (as Ollama\'s; a'
        " request's own wins), pinned (never unloaded), placement (a placement spec),"
        " context_length. Checked at start: a bad one stops the command.",
    ),
]
AllowImageUrls = Annotated[
    bool,
    typer.Option(
        "--allow-image-urls",
        help="Fetch the images requests give by http(s) URL (from public addresses only, up to"
        " the image size limit); without it, a request sends its images as data.",
    ),
]
DEFAULT_MAX_BODY_TEXT = "32M"
# An idle kept-alive connection is closed after this. Longer than the clients' own pool expiry
# (httpx, under the openai and anthropic SDKs: 5 s, uvicorn's default too), so the client drops
# an idle connection first: with equal times, a request sent on one just as the server closed
# it fails with a read error. nginx's default.
KEEP_ALIVE_S = 75


def max_body_bytes(text: str) -> int:
    """``--max-body``: '32M', '1G', '1000000' -> bytes (more than 0)."""
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{text!r}: {exc}", param_hint="--max-body") from None
    if value <= 0:
        raise typer.BadParameter(f"{text!r}: a size above 0", param_hint="--max-body")
    return value


class ApiServer(uvicorn.Server):
    """uvicorn, with signals left to the `shoal` process that runs it: Ctrl-C stops every
    service of `shoal up` in order, not only the API."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class ApiTls:
    cert: Path
    key: Path


def api_tls(cert: Path | None, key: Path | None) -> ApiTls | None:
    if (cert is None) != (key is None):
        typer.echo("error: --tls-cert and --tls-key go together", err=True)
        raise typer.Exit(1)
    return ApiTls(cert, key) if cert is not None and key is not None else None


def api_url(host: str, port: int, tls: ApiTls | None) -> str:
    return f"{'https' if tls else 'http'}://{host}:{port}/v1"


def max_tokens_limit(limit: int) -> int | None:
    """``--max-tokens`` as ``ApiConfig`` takes it (None: until the context is full)."""
    if limit == 0:
        typer.echo("error: --max-tokens 0: an answer is 1 token or more (-1: no limit)", err=True)
        raise typer.Exit(1)
    return None if limit < 0 else limit


def reasoning_budget(budget: int) -> int | None:
    """``--reasoning-budget`` as ``ApiConfig`` takes it (None: unbounded); 0 is an error: a
    request turns the thinking off itself."""
    if budget == 0:
        typer.echo(
            "error: --reasoning-budget 0: a budget is 1 token or more (-1: unbounded); a"
            " request turns thinking off itself (reasoning_effort 'none', think false)",
            err=True,
        )
        raise typer.Exit(1)
    return None if budget < 0 else budget


def api_server(config: ApiConfig, host: str, port: int, tls: ApiTls | None = None) -> ApiServer:
    return ApiServer(
        uvicorn.Config(
            create_app(config),
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            ssl_certfile=str(tls.cert) if tls else None,
            ssl_keyfile=str(tls.key) if tls else None,
            # Headers bounded in size and time (uvicorn bounds them only with h11), idle
            # connections closed, connections past the limit answered 503.
            http=bounded_httptools(config.max_header_bytes, config.header_timeout_s),
            timeout_keep_alive=KEEP_ALIVE_S,
            limit_concurrency=connection_limit(config.max_connections),
        )
    )


async def serve_until(server: ApiServer, stop: asyncio.Event) -> None:
    task = asyncio.create_task(server.serve())
    await asyncio.wait(
        {task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    server.should_exit = True
    await task


def cli_aliases(items: list[str] | None) -> dict[str, str]:
    try:
        return parse_aliases(items)
    except ValueError as exc:
        typer.echo(f"error: --alias: {exc}", err=True)
        raise typer.Exit(1) from None


def model_defaults(path: Path | None, aliases: dict[str, str]) -> ModelDefaults:
    """``--model-defaults``, read and checked (``aliases``: the API's own); a bad file is an
    error line naming the model and the key, and the command stops."""
    if path is None:
        return ModelDefaults()
    try:
        return parse_model_defaults(path.read_text(encoding="utf-8"), aliases)
    except (OSError, UnicodeDecodeError, ModelDefaultsError) as exc:
        typer.echo(f"error: --model-defaults {path}: {exc}", err=True)
        raise typer.Exit(1) from None


def check_port_free(host: str, port: int, what: str, option: str) -> None:
    if port_in_use(host, port):
        typer.echo(
            f"error: port {port} on {host} is already in use: choose another {what}"
            f" port with {option}",
            err=True,
        )
        raise typer.Exit(1)


def api(
    nats: NatsUrl = DEFAULT_NATS,
    db: DbUrl = DEFAULT_DB,
    host: Host = "127.0.0.1",
    port: Port = 8000,
    api_key: ApiKeys = None,
    api_key_file: ApiKeyFiles = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
    alias: Aliases = None,
    default_model: Annotated[
        str | None, typer.Option(help="The model of requests that name none.")
    ] = None,
    cors_origin: CorsOrigins = None,
    max_queued: MaxQueued = None,
    allowed_host: AllowedHosts = None,
    max_body: MaxBody = DEFAULT_MAX_BODY_TEXT,
    body_timeout: BodyTimeout = DEFAULT_BODY_TIMEOUT_S,
    load_on_demand: LoadOnDemand = True,
    on_demand: OnDemand = "admins",
    log_wait: LogWait = RETRY_FOR_S,
    reasoning_budget_tokens: ReasoningBudget = -1,
    max_tokens: MaxTokens = -1,
    allow_image_urls: AllowImageUrls = False,
    model_defaults_file: ModelDefaultsFile = None,
) -> None:
    """Serve the HTTP API: OpenAI's, Anthropic's and Ollama's endpoints, and cluster control."""
    setup_logging()
    tls = api_tls(tls_cert, tls_key)
    aliases = cli_aliases(alias)
    defaults = model_defaults(model_defaults_file, aliases)
    keys = api_keys(api_key, api_key_file)
    exposed = refuse_exposure(host, None, keys, None) or refuse_wildcards(
        keys, allowed_host, cors_origin
    )
    if exposed:
        typer.echo(f"error: {exposed}", err=True)
        raise typer.Exit(1)
    check_port_free(host, port, "API", "--port")
    config = ApiConfig(
        nats_url=nats,
        db_url=db,
        api_keys=keys,
        aliases=aliases,
        default_model=default_model,
        cors_origins=tuple(cors_origin or ()),
        max_queued=max_queued,
        listen_hosts=(host,),
        allowed_hosts=tuple(allowed_host or ()),
        max_body_bytes=max_body_bytes(max_body),
        body_timeout_s=body_timeout,
        load_on_demand=load_on_demand,
        on_demand=on_demand_roles(on_demand),
        log_wait_s=log_wait,
        reasoning_budget=reasoning_budget(reasoning_budget_tokens),
        max_tokens=max_tokens_limit(max_tokens),
        allow_image_urls=allow_image_urls,
        model_defaults=defaults,
    )
    typer.echo(f"API on {api_url(host, port, tls)}" + (" (API keys required)" if keys else ""))

    async def main(stop: asyncio.Event) -> None:
        await serve_until(api_server(config, host, port, tls), stop)

    run_until_signal(main)
