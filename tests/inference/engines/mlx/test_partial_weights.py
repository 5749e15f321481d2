"""An MLX rank loads from a directory holding only the safetensors files of its layers (what its
node fetched from the models bucket), and computes what it would with all of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from events.catalogue import WeightFile
from inference.engines.mlx.ring import PipelineShard
from inference.engines.mlx.stage import Stage
from modelfiles.shard_files import SAFETENSORS_INDEX, needed_files

# The tiny model's 4 layers in three files, as the Hub's sharded checkpoints are.
FILES = {
    "model-00001-of-00003.safetensors": (
        "model.embed_tokens.",
        "model.layers.0.",
        "model.layers.1.",
    ),
    "model-00002-of-00003.safetensors": ("model.layers.2.",),
    "model-00003-of-00003.safetensors": ("model.layers.3.", "model.norm.", "lm_head."),
}


def _sharded(tiny: Path, out: Path) -> Path:
    out.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    weights = mx.load(str(tiny / "model.safetensors"))
    assert isinstance(weights, dict)
    weight_map: dict[str, str] = {}
    for name, prefixes in FILES.items():
        part = {k: v for k, v in weights.items() if k.startswith(prefixes)}
        mx.save_safetensors(str(out / name), part, metadata={"format": "mlx"})
        weight_map |= dict.fromkeys(part, name)
    assert set(weight_map) == set(weights)
    (out / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return out


def _only(sharded: Path, out: Path, shard: PipelineShard) -> Path:
    """A node's directory for ``shard``: the files ``needed_files`` picks, nothing else."""
    index = json.loads((sharded / SAFETENSORS_INDEX).read_text())["weight_map"]
    files = [
        WeightFile(name=f.name, object="o", size=1, sha256="0" * 64) for f in sharded.iterdir()
    ]
    wanted = needed_files(
        files, "mlx", shard.rank, shard.start_layer, shard.end_layer, shard.n_layers, index
    )
    out.mkdir()
    for f in wanted:
        (out / f.name).symlink_to(sharded / f.name)
    return out


def test_a_rank_loads_only_its_files_and_computes_the_same(tiny_mlx: Path, tmp_path: Path) -> None:
    sharded = _sharded(tiny_mlx, tmp_path / "sharded")
    hosts = ("127.0.0.1:1", "127.0.0.1:2")
    first, last = (PipelineShard(r, 2, b, e, 4, hosts) for r, (b, e) in enumerate([(0, 2), (2, 4)]))
    mine = _only(sharded, tmp_path / "rank1", last)
    assert sorted(p.name for p in mine.glob("*.safetensors")) == [
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert sorted(
        p.name for p in _only(sharded, tmp_path / "rank0", first).glob("*.safetensors")
    ) == ["model-00001-of-00003.safetensors"]

    whole = [Stage.load(sharded, s) for s in (first, last)]
    partial = Stage.load(mine, last)
    x = whole[0].hidden(mx.array([[1, 2, 3]]), whole[0].new_cache())
    expected = whole[1].logits(whole[1].hidden(x, whole[1].new_cache()))
    got = partial.logits(partial.hidden(x, partial.new_cache()))
    assert mx.array_equal(got, expected).item()


def test_a_rank_missing_its_own_file_says_which(tiny_mlx: Path, tmp_path: Path) -> None:
    sharded = _sharded(tiny_mlx, tmp_path / "sharded")
    last = PipelineShard(1, 2, 2, 4, 4, ("a:1", "b:2"))
    mine = _only(sharded, tmp_path / "rank1", last)
    (mine / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="rank 1 needs model-00002-of-00003"):
        Stage.load(mine, last)
