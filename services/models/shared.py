"""Model weights through the models bucket: stored once by whoever adds the model, fetched by
each node that runs a shard of it into its cache (``weights_cache``).

Objects are named by their content (``sha256/<hex>``): a file is stored once however many
models (or adds of the same model) name it, a second add stores nothing, and an object can
never change under a ``ModelAdded`` that names it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo

from bus.events import WeightFile
from bus.object_store import digest_hex, fetch_file, object_info, put_file
from bus.streams import MODELS_BUCKET
from services.models.shard_files import SAFETENSORS_INDEX, gguf_entry, needed_files, split_parts
from services.models.weights_cache import WeightsCache, sha256_of

log = logging.getLogger(__name__)

# Bytes done and bytes in all, for a whole set of files.
Progress = Callable[[int, int], None]


class WeightsUnavailable(RuntimeError):
    """The weights cannot be had from the bucket; the message says why and what to do."""


def object_name(sha256: str) -> str:
    return f"sha256/{sha256}"


def model_files(path: Path) -> list[tuple[str, Path]]:
    """The files of a model at ``path`` under the names they keep in its directory: a GGUF
    file (with its other parts, if split), or every file of an MLX directory."""
    if path.is_dir():
        return sorted(
            (str(f.relative_to(path)), f)
            for f in path.rglob("*")
            if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
        )
    parts = split_parts(path.name)
    missing = [p for p in parts if not (path.parent / p).is_file()]
    if missing:
        raise WeightsUnavailable(f"{path} is one part of a split GGUF; missing: {missing}")
    return [(p, path.parent / p) for p in parts]


async def store_files(
    js: JetStreamContext,
    files: list[tuple[str, Path]],
    *,
    cache: WeightsCache | None = None,
    on_progress: Progress | None = None,
) -> list[WeightFile]:
    """Store each ``(name, path)`` in the models bucket unless an object of the same content
    is there already. With ``cache``, each file also becomes a blob of this machine's cache
    (a link), so that a worker sharing it does not fetch what is on its disk."""
    hashed: list[tuple[str, Path, str]] = []
    for name, path in files:
        hashed.append((name, path, await asyncio.to_thread(sha256_of, path)))
    total = sum(p.stat().st_size for _, p, _ in hashed)
    done = 0
    out: list[WeightFile] = []
    for name, path, sha in hashed:
        size = path.stat().st_size
        weight = WeightFile(name=name, object=object_name(sha), size=size, sha256=sha)
        held = await object_info(js, MODELS_BUCKET, weight.object)
        if held is None or held.size != size or _hex(held) != sha:
            base = done

            def progress(n: int, base: int = base) -> None:
                if on_progress is not None:
                    on_progress(base + n, total)

            await put_file(js, MODELS_BUCKET, weight.object, path, description=name,
                           on_progress=progress)  # fmt: skip
        done += size
        if on_progress is not None:
            on_progress(done, total)
        if cache is not None and not cache.holds(weight):
            cache.adopt(path, weight)
        out.append(weight)
    return out


def _hex(info: ObjectInfo) -> str | None:
    try:
        return digest_hex(info.digest or "")
    except ValueError:
        return None


async def fetch_files(
    js: JetStreamContext,
    cache: WeightsCache,
    files: list[WeightFile],
    on_progress: Progress | None = None,
) -> None:
    """Make ``cache`` hold every one of ``files``: those it lacks are fetched from the bucket
    (resumed where an earlier fetch stopped, digest checked). Progress counts the bytes of
    the files fetched, not of those already here."""
    missing = [f for f in files if not cache.holds(f)]
    total = sum(f.size for f in missing)
    done = 0
    for f in missing:
        async with cache.lock(f.sha256):
            if not cache.holds(f):  # another runner of this node may have fetched it meanwhile
                info = await object_info(js, MODELS_BUCKET, f.object)
                if info is None:
                    raise WeightsUnavailable(
                        f"{f.name}: object {f.object} is not in the {MODELS_BUCKET} bucket (was"
                        " it deleted?): add the model again with `shoal models add`"
                    )
                if _hex(info) != f.sha256 or info.size != f.size:
                    raise WeightsUnavailable(
                        f"{f.name}: object {f.object} in {MODELS_BUCKET} is not the file the"
                        " model names (another digest or size)"
                    )
                base = done

                def progress(n: int, base: int = base) -> None:
                    if on_progress is not None:
                        on_progress(base + n, total)

                log.info("fetching %s (%d bytes) from %s", f.name, f.size, MODELS_BUCKET)
                await fetch_file(js, MODELS_BUCKET, info, cache.blob(f.sha256),
                                 on_progress=progress)  # fmt: skip
        done += f.size
        if on_progress is not None:
            on_progress(done, total)


async def shard_model_path(
    js: JetStreamContext,
    cache: WeightsCache,
    model_id: str,
    files: list[WeightFile],
    *,
    engine: str,
    rank: int,
    start: int,
    end: int,
    n_layers: int,
    on_progress: Progress | None = None,
) -> Path:
    """What a shard's engine is given, with the files it needs in the cache: the model's
    directory (MLX) or its GGUF file (the first part of a split one)."""
    weight_map = None
    if engine == "mlx":
        index = [f for f in files if f.name == SAFETENSORS_INDEX]
        await fetch_files(js, cache, index)
        if index:
            cache.link(model_id, index)
            text = (cache.model_dir(model_id) / SAFETENSORS_INDEX).read_text()
            weight_map = json.loads(text).get("weight_map")
    wanted = needed_files(files, engine, rank, start, end, n_layers, weight_map)
    await fetch_files(js, cache, wanted, on_progress)
    directory = cache.link(model_id, wanted)
    if engine == "mlx":
        return directory
    return directory / gguf_entry(files).name
