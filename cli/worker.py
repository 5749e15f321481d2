"""`shoal worker` (this machine joins the cluster) and `shoal runner` (started by a worker)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import psutil
import typer

from bus.connection import connect
from bus.streams import StreamSettings
from bus.sync_policy import warn_if_lazy
from cli.cluster import Secret, discover, use_secret
from cli.options import (
    DEFAULT_CACHE_SIZE_TEXT,
    DEFAULT_NATS,
    CacheSizeText,
    DataHost,
    RunnerSlots,
    WarmRunner,
    absolute,
    cache_size,
    run_until_signal,
    setup_logging,
)
from inference.offload import visible_devices
from process.memory import give_back
from services.discovery.announcement import Announcement
from services.runner import RunnerSpec
from services.runner.main import preload as preload_runner
from services.runner.main import run_runner
from services.worker.identity import node_id as load_node_id
from services.worker.profile import parse_memory_limit
from services.worker.worker import Worker, WorkerConfig

log = logging.getLogger(__name__)


def worker(
    nats: Annotated[
        str | None,
        typer.Option(
            "--nats",
            envvar="SHOAL_NATS_URL",
            help="NATS server URL(s), comma-separated [default: the cluster of --secret, found"
            f" on the LAN; without a secret {DEFAULT_NATS}].",
        ),
    ] = None,
    secret: Secret = None,
    discover_timeout: Annotated[
        float, typer.Option(help="Seconds to look for the cluster of --secret on the LAN.")
    ] = 60.0,
    node_id: Annotated[
        str | None, typer.Option(help="This node's id (kept in the data dir).")
    ] = None,
    data_dir: Annotated[
        Path, typer.Option(help="Node id, models and runner logs.", callback=absolute)
    ] = Path("data/worker"),
    memory_limit: Annotated[
        str | None, typer.Option(help="Memory this node offers to placement, e.g. 512M, 8G.")
    ] = None,
    heartbeat: Annotated[float, typer.Option(help="Seconds between resource profiles.")] = 2.0,
    runner_threads: Annotated[
        int | None,
        typer.Option(
            help="Threads per runner [default: every core]; lower it when several "
            "workers or runners share a machine."
        ),
    ] = None,
    data_host: DataHost = None,
    slots: RunnerSlots = None,
    cache_size_text: CacheSizeText = DEFAULT_CACHE_SIZE_TEXT,
    warm_runner: WarmRunner = True,
) -> None:
    """Join the cluster as a worker: heartbeat, and run the runners placed on this node."""
    setup_logging()
    cluster = use_secret(secret)
    if nats is None:
        found = discover(cluster, discover_timeout) if cluster is not None else None
        if cluster is not None and found is None:
            raise typer.Exit(1)
        nats = DEFAULT_NATS if found is None else joining(found)
    budget = cache_size(cache_size_text)
    limit = parse_memory_limit(memory_limit) if memory_limit else None
    config = WorkerConfig(
        nats_url=nats,
        node_id=load_node_id(data_dir, node_id),
        data_dir=data_dir,
        memory_limit=limit,
        heartbeat_s=heartbeat,
        runner_threads=runner_threads,
        data_host=data_host,
        slots=slots,
        cache_size=budget,
        stream_settings=StreamSettings.from_env(),
        warm_runner=warm_runner,
    )
    serve_worker(config)


def joining(found: Announcement) -> str:
    """The NATS URLs of a cluster found on the LAN, said."""
    urls = ",".join(found.nats_urls)
    api = f"; its API: {found.api_url}" if found.api_url else ""
    typer.echo(f"found the cluster of this secret at {urls}{api}")
    return urls


def serve_worker(config: WorkerConfig) -> None:
    """Run this machine's worker until Ctrl-C."""
    typer.echo(f"worker {config.node_id} joining {config.nats_url}")

    async def main(stop: asyncio.Event) -> None:
        nc = await connect(config.nats_url, name=f"shoal-worker-{config.node_id}")
        await warn_if_lazy(config.nats_url)
        try:
            await Worker(nc, config).run(stop)
        finally:
            await nc.drain()

    run_until_signal(main)


def runner(
    spec: Annotated[
        str,
        typer.Option(
            help="The RunnerSpec, as JSON, or '-' to read it from the standard input (as the"
            " worker gives it: the spec holds the NATS URL, and a command line is anyone's to"
            " read)."
        ),
    ],
    preload: Annotated[
        bool,
        typer.Option(
            help="Load llama.cpp's engine before reading the spec (a worker's warm spare, on a"
            " node without accelerators: a spec may limit which accelerators it sees).",
            hidden=True,
        ),
    ] = False,
) -> None:
    """Serve one shard (started by a worker; not usually run by hand)."""
    setup_logging()
    # SIGUSR1 stops a runner and keeps its process for the next spec (``_serve``); between
    # specs it changes nothing (its default would end the process).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if preload:
        preload_runner()
    code = 0
    for served, parsed in enumerate(_specs(spec)):
        if parsed.log_path is not None:
            _write_output_to(Path(parsed.log_path))
            waited = time.time() - psutil.Process().create_time()
            before = f", which served {served} runner(s) before" if served else ""
            log.info(
                "runner %s: the warm spare, started %.1f s ago%s", parsed.runner_id, waited, before
            )
        # Before any engine is loaded: the process sees only its shard's accelerators.
        os.environ.update(visible_devices(parsed.shard, os.environ))
        code, recycled = _serve(parsed)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if code != 0 or not recycled:
            break
        give_back()
        log.info("runner %s stopped; this process waits for the next spec", parsed.runner_id)
    # Without the interpreter's teardown: freeing a model whose later stages are gone makes
    # ggml abort (it cannot reach their RPC servers), which would turn a clean stop or a
    # reported failure into SIGABRT. What a runner holds, the OS frees.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _specs(given: str) -> Iterator[RunnerSpec]:
    """The spec given on the command line; with '-', each line of the standard input (a
    worker gives its next spec to a process whose runner it stopped with SIGUSR1)."""
    if given != "-":
        yield RunnerSpec.model_validate_json(given)
        return
    for line in sys.stdin:
        if line.strip():
            yield RunnerSpec.model_validate_json(line)


def _serve(spec: RunnerSpec) -> tuple[int, bool]:
    """Run ``spec``'s runner until it is asked to stop; its exit code, and whether SIGUSR1
    asked (the process then waits for another spec: its imports are done)."""
    code, recycled = 0, False

    async def main(stop: asyncio.Event) -> None:
        nonlocal code

        def stopped_by(signum: int) -> None:
            nonlocal recycled
            # SIGTERM after SIGUSR1 (a worker that waited too long for Stopped): the end.
            recycled = signum == signal.SIGUSR1
            stop.set()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            loop.add_signal_handler(signum, stopped_by, signum)
        code = await run_runner(spec, stop)

    run_until_signal(main)
    return code, recycled


def _write_output_to(path: Path) -> None:
    """This process's standard output and error from now on go to ``path`` (appended): a warm
    spare learns which runner it is, and so its log, only with its spec."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
