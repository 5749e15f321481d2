"""Which of a model's weight files a shard needs, and which one an engine is given. Pure.

- llama.cpp: the pipeline's head loads the model (all its GGUF parts, and its projector) and
  sends each later stage its layers over RPC, so a later stage needs no file at all.
- MLX: every rank loads its own layers, so it needs the small files (config, tokenizer, the
  safetensors index) and only the safetensors files that hold a tensor of its layers, plus the
  embeddings for the first rank and the final norm and output layer for the last.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from events.catalogue import WeightFile

# llama.cpp's split files: <prefix>-00001-of-00003.gguf, found beside the first by name.
SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
SAFETENSORS_INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def gguf_entry(files: list[WeightFile]) -> WeightFile:
    """The file llama.cpp is given: the only GGUF, or the first part of a split one (a
    projector, the other GGUF a model may have, is not its weights)."""
    weights = (f for f in files if f.name.endswith(".gguf") and not f.projector)
    ggufs = sorted(weights, key=lambda f: f.name)
    if not ggufs:
        raise ValueError("the model has no .gguf file")
    firsts = [f for f in ggufs if (m := SPLIT_GGUF.search(f.name)) and int(m.group(1)) == 1]
    if firsts:
        return firsts[0]
    if len(ggufs) > 1:
        names = ", ".join(f.name for f in ggufs)
        raise ValueError(f"several GGUF files that are not the parts of one ({names})")
    return ggufs[0]


def split_parts(name: str) -> list[str]:
    """Every part's name of a split GGUF, given any part's (just ``name`` if not split)."""
    m = SPLIT_GGUF.search(name)
    if m is None:
        return [name]
    count = int(m.group(2))
    stem = name[: m.start()]
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def mlx_files_for_layers(
    weight_map: Mapping[str, str], start: int, end: int, n_layers: int
) -> set[str]:
    """The safetensors files (of an index's ``weight_map``: tensor -> file) that hold what a
    rank with layers ``start..end`` (exclusive) of ``n_layers`` loads."""
    first, last = start == 0, end >= n_layers
    # Without an lm_head of its own, the output layer is the embedding (tied).
    tied = not any("lm_head" in t for t in weight_map)
    needed: set[str] = set()
    for tensor, file in weight_map.items():
        m = _LAYER.search(tensor)
        if m is not None:
            if start <= int(m.group(1)) < end:
                needed.add(file)
        elif "embed" in tensor:
            if first or (last and tied):
                needed.add(file)
        elif last:  # the final norm and the output layer
            needed.add(file)
    return needed


def needed_files(
    files: list[WeightFile],
    engine: str,
    rank: int,
    start: int,
    end: int,
    n_layers: int,
    weight_map: Mapping[str, str] | None = None,
) -> list[WeightFile]:
    """The files a shard fetches. For MLX, ``weight_map`` is the safetensors index's (None
    when the model has no index: one safetensors file, which every rank needs)."""
    if engine == "diffusers":  # a pipeline is one shard: all its files
        return list(files)
    if engine != "mlx":
        return list(files) if rank == 0 else []
    if weight_map is None:
        return list(files)
    wanted = mlx_files_for_layers(weight_map, start, end, n_layers)
    indexed = set(weight_map.values())
    return [f for f in files if f.name not in indexed or f.name in wanted]
