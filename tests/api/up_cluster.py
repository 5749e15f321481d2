"""One `shoal up` (SmolLM2-135M on llama.cpp) for every SDK test of the session, with an alias
for the model, and a second `shoal api` process reading the same log and database: what one
API process stored, the other must serve."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bus.embedded import free_port
from harness.processes import SHOAL, wait_healthy
from harness.shoal_up import Drained, read_until_ready, start, stop
from tests.api.embed_instance import add_embed_instance
from tests.cli.shoal_up import KEY, MODEL

ALIAS = "claude-shoal-test"


@dataclass(frozen=True)
class UpCluster:
    base: str  # http://127.0.0.1:PORT of `shoal up`'s API
    second: str  # the same, of the second API process
    key: str
    model: str
    alias: str
    nats_url: str
    db_url: str


def _after(lines: list[str], label: str) -> str:
    """The value of one of `shoal up`'s start lines (``NATS      nats://...``)."""
    line = next(x for x in lines if x.startswith(label))
    return line.removeprefix(label).split()[0]


@pytest.fixture(scope="session")
def up_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    data: Path = tmp_path_factory.mktemp("up") / "data"
    port, second_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    up = start(
        [
            SHOAL,
            "up",
            "--data-dir",
            str(data),
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--runner-threads",
            "1",
            "--alias",
            f"{ALIAS}={MODEL}",
        ]
    )
    drained: list[Drained] = []
    try:
        lines = asyncio.run(read_until_ready(up))
        drained.append(Drained(up))
        nats_url, db_url = _after(lines, "NATS"), _after(lines, "database")
        second = start(
            [
                SHOAL,
                "api",
                "--nats",
                nats_url,
                "--db",
                db_url,
                "--port",
                str(second_port),
                "--api-key",
                KEY,
            ]
        )
        drained.append(Drained(second))
        base, other = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{second_port}"
        asyncio.run(wait_healthy(other))
        asyncio.run(add_embed_instance(base, KEY, MODEL))  # for the embeddings' tests
        yield UpCluster(base, other, KEY, MODEL, ALIAS, nats_url, db_url)
    finally:
        for proc in reversed(drained):
            proc.stop()
        if not drained:
            stop(up)
