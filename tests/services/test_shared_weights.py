"""Weights shared between nodes, end to end: two workers on test hosts of their own (their own
addresses: the weights cross the bridge from one host's weights server to the other); a model
added from a file on one worker's machine is served split over both, its head on the
worker that never had the file, which took it from the other worker's disk (asked over NATS,
sent over HTTP): no copy in the models bucket. In the same cluster, instances of catalogue
models the cluster does not know yet."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats, free_port
from bus.stores.object_store import object_info
from bus.streams import MODELS_BUCKET
from events.catalogue import InstancePlaced, ModelAdded, NodeJoined, RunnerStateChanged
from harness.hosts import Network
from harness.processes import SHOAL, Processes, wait_healthy
from services.models.catalogue import card_for
from services.models.resolve import resolve_model
from services.models.weights_cache import sha256_of
from tests.services.event_log import EventLog

pytestmark = pytest.mark.slow

NODES = ("w-a", "w-b")
QUESTION = "What is the capital city of France? Answer in one word."


async def _catalogue_models_on_demand(client: httpx.AsyncClient, url: str, log: EventLog) -> None:
    """An instance of a catalogue model the cluster does not know yet adds it (the API's
    machine stores its weights in the bucket, the worker fetches them), instead of a 404; one
    that cannot be placed is refused before anything is downloaded; one whose weights this
    machine cannot get (no network here) is a clear 503."""
    asked = await client.post(f"{url}/v1/instances", json={"model": "gemma3-270m"}, timeout=120)
    assert asked.status_code == 202, asked.text
    assert asked.json()["added"] is True
    added = await log.wait_for(ModelAdded, lambda e: e.model_id == "gemma3-270m")
    assert added.path is None and len(added.files) == 1 and added.size_bytes == 253_113_024
    placed = await log.wait_for(InstancePlaced, lambda e: e.instance_id == asked.json()["id"], 30)
    (shard,) = placed.shards
    ready = await log.wait_for(
        RunnerStateChanged, lambda e: e.runner_id == shard.runner_id and e.state == "Ready", 120
    )
    assert ready.node_id in NODES
    body = {
        "model": "gemma3-270m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    chat = await client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert chat.status_code == 200, chat.text

    too_big = await client.post(f"{url}/v1/instances", json={"model": "llama3.3-70b"})
    assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "placement_rejected"
    assert not log.of(ModelAdded, lambda e: e.model_id == "llama3.3-70b")  # nothing fetched
    unknown = await client.post(f"{url}/v1/instances", json={"model": "no-such-model"})
    assert unknown.status_code == 404 and "shoal models list" in unknown.text
    offline = await client.post(f"{url}/v1/instances", json={"model": "qwen3-0.6b"}, timeout=60)
    assert offline.status_code == 503, offline.text
    error = offline.json()["error"]
    assert error["code"] == "model_unavailable" and "Hugging Face Hub" in error["message"]


def _copy_of_smollm2(tmp: Path) -> Path:
    """A copy under another name and id: no node finds these bytes in a package of its own."""
    src = resolve_model(card_for("smollm2-135m"), tmp / "unused")
    (tmp / "src").mkdir()
    return Path(shutil.copy(src, tmp / "src" / "smol.gguf"))


@pytest.mark.parametrize("hosts", [2], indirect=True)
async def test_a_model_added_on_one_node_is_fetched_from_its_disk_by_the_other(
    hosts: Network, hosts_nats: EmbeddedNats, hosts_js: JetStreamContext, tmp_path: Path
) -> None:
    js, nats, db = hosts_js, hosts_nats.url, f"sqlite:///{tmp_path / 'shoal.db'}"
    env = {**os.environ, "SHOAL_DATA_DIR": str(tmp_path / "cli")}
    log = await EventLog().start(js)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    weights = await asyncio.to_thread(_copy_of_smollm2, tmp_path)
    sha = await asyncio.to_thread(sha256_of, weights)
    with Processes(tmp_path / "logs", env) as procs:
        procs.start("projector", "projector", "--nats", nats, "--db", db)
        procs.start("planner", "planner", "--nats", nats, "--db", db)
        procs.start("api", "api", "--nats", nats, "--db", db, "--port", str(port))
        for node, host in zip(NODES, hosts.hosts, strict=True):
            procs.start(
                node,
                "join",
                "--nats",
                nats,
                "--node-id",
                node,
                "--data-dir",
                str(tmp_path / node),
                "--heartbeat",
                "1",
                "--runner-threads",
                "1",
                host=host,
            )
        await log.wait_count(NodeJoined, lambda e: True, 2, timeout=60)

        # Added on w-a's machine (its worker's cache): it stays where it is.
        added = await asyncio.to_thread(
            subprocess.run,
            [
                SHOAL,
                "models",
                "add",
                "smol-copy",
                "--path",
                str(weights),
                "--nats",
                nats,
                "--cache-dir",
                str(tmp_path / "w-a" / "models"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert added.returncode == 0, added.stderr
        assert "no copy in the bucket" in added.stdout
        event = await log.wait_for(ModelAdded)
        assert event.path is None and [f.sha256 for f in event.files] == [sha]
        assert (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages == 0

        # The head (rank 0, which loads the file) on w-b, the later stage on w-a.
        spec = json.dumps({"chat": {"devices": ["w-b:cpu", "w-a:cpu"]}})
        created = await asyncio.to_thread(
            subprocess.run,
            [
                SHOAL,
                "instances",
                "create",
                "smol-copy",
                "--id",
                "inst",
                "--placement",
                spec,
                "--nats",
                nats,
                "--db",
                db,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert created.returncode == 0, created.stderr
        placed = await log.wait_for(InstancePlaced, timeout=30)
        head = next(s for s in placed.shards if s.rank == 0)
        assert head.node_id == "w-b" and len(placed.shards) == 2
        await log.wait_for(
            RunnerStateChanged, lambda e: e.runner_id == head.runner_id and e.state == "Ready", 120
        )

        await wait_healthy(url)
        body = {
            "model": "smol-copy",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}],
        }
        async with httpx.AsyncClient() as client:
            response = await client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert "Paris" in response.json()["choices"][0]["message"]["content"]
            await _catalogue_models_on_demand(client, url, log)

    # w-b fetched it from w-a: a file of its own in its cache, with the model's digest, and its
    # head runner said so (Downloading, with progress up to 1). The bucket still has no copy.
    blob = tmp_path / "w-b" / "models" / "blobs" / sha
    assert blob.is_file() and not blob.is_symlink()
    assert await asyncio.to_thread(sha256_of, blob) == sha
    downloading = log.of(
        RunnerStateChanged, lambda e: e.runner_id == head.runner_id and e.state == "Downloading"
    )
    assert downloading and downloading[-1].progress == 1.0
    runner_log = (tmp_path / "w-b" / "logs" / f"runner-{head.runner_id}.log").read_text()
    assert "from node w-a" in runner_log
    assert f"http://{hosts.hosts[0].address}:" in runner_log  # across the bridge
    assert await object_info(js, MODELS_BUCKET, event.files[0].object) is None
    # w-a, a later stage (llama.cpp's RPC server: the head sends it its layers), fetched none.
    assert not (tmp_path / "w-a" / "models" / "blobs" / f"{sha}.partial").exists()
    stage = next(s for s in placed.shards if s.rank == 1)
    assert not log.of(
        RunnerStateChanged, lambda e: e.runner_id == stage.runner_id and e.state == "Downloading"
    )
    await log.stop()
