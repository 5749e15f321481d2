"""`shoal models remove` and two `shoal models add` at once, as real processes against a real
nats-server and projection (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.stores.object_store import object_info
from bus.streams import MODELS_BUCKET
from events.catalogue import InstanceDeleteRequested, InstanceRequested, ModelAdded
from services.models.shared import store_files
from tests.projectors.helpers import running_projector, wait_for_seq
from tests.services.models.test_cli_models import SHOAL, models_added, one_line_error

pytestmark = pytest.mark.slow


async def shoal(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SHOAL, "models", *args],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "SHOAL_DATA_DIR": str(home)},
        )

    return await asyncio.to_thread(run)


def _weights(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return path


async def test_remove_refuses_a_model_in_use_then_removes_it(
    nats_server: EmbeddedNats,
    js: JetStreamContext,
    engine: AsyncEngine,
    db_url: str,
    tmp_path: Path,
) -> None:
    path = _weights(tmp_path / "m.gguf", 300_000)
    (f,) = await store_files(js, [(path.name, path)])
    pub = Publisher(js)
    await pub.publish(ModelAdded(model_id="m", origin="t", n_layers=1, size_bytes=1, files=[f]))
    ack = await pub.publish(InstanceRequested(instance_id="i1", model_id="m", origin="t"))
    url = nats_server.url
    async with running_projector(js, engine) as projector:
        await wait_for_seq(projector, ack.seq)
        used = await shoal("remove", "m", "--nats", url, "--db", db_url, home=tmp_path)
        one_line_error(used, "i1", "shoal instances delete")
        assert await object_info(js, MODELS_BUCKET, f.object) is not None

        ack = await pub.publish(InstanceDeleteRequested(instance_id="i1", origin="t"))
        await wait_for_seq(projector, ack.seq)
        out = await shoal("remove", "m", "--nats", url, "--db", db_url, home=tmp_path)
        assert out.returncode == 0, out.stderr
        assert (
            "removed m" in out.stdout and f"deleted 1 object(s) from {MODELS_BUCKET}" in out.stdout
        )
        assert await object_info(js, MODELS_BUCKET, f.object) is None

        again = await shoal("remove", "m", "--nats", url, "--db", db_url, home=tmp_path)
        one_line_error(again, "knows no model 'm'")


async def test_two_adds_of_one_file_at_once_store_it_once(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    mlx = tmp_path / "mlx"  # an MLX directory: its config says what the add needs to know
    _weights(mlx / "model.safetensors", 3 * 1024 * 1024)
    (mlx / "config.json").write_text('{"num_hidden_layers": 2, "max_position_embeddings": 512}')
    url = nats_server.url
    adds = [
        shoal("add", name, "--path", str(mlx), "--bucket", "--nats", url, home=tmp_path / name)
        for name in ("a", "b")
    ]
    for out in await asyncio.gather(*adds):
        assert out.returncode == 0, out.stderr
    a, b = sorted(await models_added(js), key=lambda e: e.model_id)
    assert a.files == b.files and len(a.files) == 2
    chunks = 0
    for f in a.files:
        stored = await object_info(js, MODELS_BUCKET, f.object)
        assert stored is not None and stored.chunks is not None
        chunks += stored.chunks
    # Each file's chunks once, and one meta each: no second copy in the stream.
    assert (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages == chunks + 2
