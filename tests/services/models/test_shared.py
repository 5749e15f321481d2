"""A node's cache filled from the models bucket: each file once, resumed, checked; a shard's
files only; the model's directory laid out as its engine expects."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from bus.stores.object_fetch import partial_paths
from bus.streams import MODELS_BUCKET
from events.catalogue import WeightFile
from modelfiles.shard_files import (
    gguf_entry,
    mlx_files_for_layers,
    needed_files,
    split_parts,
)
from services.models.shared import (
    WeightsUnavailable,
    fetch_files,
    model_files,
    shard_model_path,
    store_files,
)
from services.models.weights_cache import WeightsCache, sha256_of


def _files(directory: Path, sizes: dict[str, int]) -> list[tuple[str, Path]]:
    out = []
    for name, size in sizes.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        out.append((name, path))
    return out


def _weight(name: str, sha: str = "0" * 64, size: int = 1) -> WeightFile:
    return WeightFile(name=name, object=f"sha256/{sha}", size=size, sha256=sha)


async def test_files_are_stored_once_and_fetched_into_a_cache(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    src = _files(
        tmp_path / "src", {"m-00001-of-00002.gguf": 300_000, "m-00002-of-00002.gguf": 200_000}
    )
    stored = await store_files(js, src, cache=WeightsCache(tmp_path / "adder"))
    assert [f.name for f in stored] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    assert all(f.object == f"sha256/{f.sha256}" for f in stored)
    # The adder's cache links its own files: nothing to fetch there.
    assert all(WeightsCache(tmp_path / "adder").holds(f) for f in stored)
    messages = (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages
    assert await store_files(js, src) == stored  # stored again: nothing new in the bucket
    assert (await js.stream_info(f"OBJ_{MODELS_BUCKET}")).state.messages == messages

    cache = WeightsCache(tmp_path / "node")
    seen: list[tuple[int, int]] = []
    path = await shard_model_path(
        nc,
        cache,
        "m",
        stored,
        engine="llamacpp",
        rank=0,
        start=0,
        end=4,
        n_layers=4,
        on_progress=lambda d, t: seen.append((d, t)),
    )
    assert path == cache.model_dir("m") / "m-00001-of-00002.gguf"
    for f, (_, original) in zip(stored, src, strict=True):
        laid_out = cache.model_dir("m") / f.name
        assert laid_out.read_bytes() == original.read_bytes()  # the parts side by side
        assert cache.blob(f.sha256).is_file() and not cache.blob(f.sha256).is_symlink()
    assert seen[-1] == (500_000, 500_000)

    # Held already: nothing fetched, no progress.
    again: list[tuple[int, int]] = []
    await fetch_files(nc, cache, stored, lambda d, t: again.append((d, t)))
    assert again == []


async def test_two_runners_of_a_node_fetch_a_file_once(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    stored = await store_files(js, _files(tmp_path / "src", {"w.gguf": 2_000_000}))
    cache = WeightsCache(tmp_path / "node")
    counts: list[list[int]] = [[], []]

    def progress(i: int) -> Callable[[int, int], None]:
        return lambda done, total: counts[i].append(done)

    await asyncio.gather(*(fetch_files(nc, cache, stored, progress(i)) for i in range(2)))
    # One fetched (its progress goes from 0), the other waited and found it in the cache.
    fetched = [c for c in counts if c and c[0] == 0]
    assert len(fetched) == 1
    assert sha256_of(cache.blob(stored[0].sha256)) == stored[0].sha256


class Stop(Exception):
    pass


async def test_a_fetch_stopped_halfway_resumes_in_the_cache(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    stored = await store_files(js, _files(tmp_path / "src", {"w.gguf": 12 * 1024 * 1024}))
    cache = WeightsCache(tmp_path / "node")

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise Stop

    with pytest.raises(Stop):
        await fetch_files(nc, cache, stored, stop)
    partial, note = partial_paths(cache.blob(stored[0].sha256))
    assert partial.exists() and note.exists() and not cache.holds(stored[0])
    resumed: list[int] = []
    await fetch_files(nc, cache, stored, lambda d, t: resumed.append(d))
    assert resumed[0] > 6 * 1024 * 1024  # from where it stopped, not from 0
    assert cache.holds(stored[0])
    assert sha256_of(cache.blob(stored[0].sha256)) == stored[0].sha256


async def test_a_file_missing_from_the_bucket_or_damaged_is_an_error(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    cache = WeightsCache(tmp_path / "node")
    with pytest.raises(WeightsUnavailable, match="the SHOAL_MODELS bucket has no copy"):
        await fetch_files(nc, cache, [_weight("w.gguf", "a" * 64)])
    (stored,) = await store_files(js, _files(tmp_path / "src", {"w.gguf": 1000}))
    lying = stored.model_copy(update={"size": 999})
    with pytest.raises(WeightsUnavailable, match="not the file the model names"):
        await fetch_files(nc, cache, [lying])


async def test_an_mlx_rank_fetches_only_the_safetensors_of_its_layers(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    src = tmp_path / "mlx"
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00003.safetensors",
            "model.layers.0.mlp.weight": "model-00001-of-00003.safetensors",
            "model.layers.1.mlp.weight": "model-00002-of-00003.safetensors",
            "model.layers.2.mlp.weight": "model-00002-of-00003.safetensors",
            "model.layers.3.mlp.weight": "model-00003-of-00003.safetensors",
            "model.norm.weight": "model-00003-of-00003.safetensors",
            "lm_head.weight": "model-00003-of-00003.safetensors",
        }
    }
    shards = {f"model-0000{i}-of-00003.safetensors": 1000 for i in (1, 2, 3)}
    files = _files(src, {"config.json": 10, "tokenizer.json": 10, **shards})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    stored = await store_files(js, model_files(src))
    assert {f.name for f in stored} == {n for n, _ in files} | {"model.safetensors.index.json"}

    cache = WeightsCache(tmp_path / "node")
    path = await shard_model_path(
        nc, cache, "m", stored, engine="mlx", rank=1, start=1, end=3, n_layers=4
    )
    assert path == cache.model_dir("m")
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "model-00002-of-00003.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]


def test_which_safetensors_a_rank_needs() -> None:
    weight_map = {
        "model.embed_tokens.weight": "a",
        "model.layers.0.x": "a",
        "model.layers.1.x": "b",
        "model.layers.2.x": "b",
        "model.layers.3.x": "c",
        "model.norm.weight": "c",
        "lm_head.weight": "d",
        "language_model.model.layers.2.y": "e",  # a multimodal model's language layers
    }
    assert mlx_files_for_layers(weight_map, 0, 1, 4) == {"a"}
    assert mlx_files_for_layers(weight_map, 1, 3, 4) == {"b", "e"}
    assert mlx_files_for_layers(weight_map, 3, 4, 4) == {"c", "d"}
    assert mlx_files_for_layers(weight_map, 0, 4, 4) == {"a", "b", "c", "d", "e"}
    # Tied (no lm_head): the last rank's output layer is the embedding.
    tied = {k: v for k, v in weight_map.items() if k != "lm_head.weight"}
    assert mlx_files_for_layers(tied, 3, 4, 4) == {"a", "c"}


def test_which_files_a_shard_needs_and_which_gguf_llama_cpp_loads() -> None:
    parts = [_weight(n) for n in ("q-00002-of-00002.gguf", "q-00001-of-00002.gguf")]
    assert needed_files(parts, "llamacpp", 0, 0, 10, 20) == parts
    assert needed_files(parts, "llamacpp", 1, 10, 20, 20) == []  # an RPC stage loads none
    assert gguf_entry(parts).name == "q-00001-of-00002.gguf"
    assert gguf_entry([_weight("one.gguf")]).name == "one.gguf"
    with pytest.raises(ValueError, match="several GGUF files"):
        gguf_entry([_weight("a.gguf"), _weight("b.gguf")])
    # A projector is a GGUF beside the weights, not them; the head fetches it with them.
    projector = _weight("mmproj-a.gguf").model_copy(update={"projector": True})
    assert gguf_entry([projector, *parts]).name == "q-00001-of-00002.gguf"
    assert needed_files([*parts, projector], "llamacpp", 0, 0, 10, 20) == [*parts, projector]
    assert needed_files([*parts, projector], "llamacpp", 1, 10, 20, 20) == []
    assert split_parts("x-00002-of-00003.gguf") == [
        "x-00001-of-00003.gguf",
        "x-00002-of-00003.gguf",
        "x-00003-of-00003.gguf",
    ]
    assert split_parts("x.gguf") == ["x.gguf"]
    mlx = [_weight("config.json"), _weight("model.safetensors")]
    assert needed_files(mlx, "mlx", 1, 2, 4, 4) == mlx  # no index: the one file for all


def test_a_split_gguf_is_added_with_all_its_parts(tmp_path: Path) -> None:
    for i in (1, 2):
        (tmp_path / f"q-0000{i}-of-00002.gguf").write_bytes(b"x")
    assert [n for n, _ in model_files(tmp_path / "q-00001-of-00002.gguf")] == [
        "q-00001-of-00002.gguf",
        "q-00002-of-00002.gguf",
    ]
    (tmp_path / "q-00002-of-00002.gguf").unlink()
    with pytest.raises(WeightsUnavailable, match="missing"):
        model_files(tmp_path / "q-00001-of-00002.gguf")


def test_a_file_name_cannot_leave_the_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="leaves its directory"):
        WeightsCache(tmp_path).link("m", [_weight("../../etc/passwd")])
