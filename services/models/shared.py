"""Model weights between nodes: each file named by its content (``sha256/<hex>``), held in
nodes' caches (``weights_cache``) and, for a model added from a machine that runs no worker,
in the models bucket.

- Added on a node (``shoal up``, ``shoal models add`` beside a worker): the files stay where
  they are, linked into that worker's cache, and the worker serves them to the runners of other
  nodes (``services/worker/weights_server.py``): one copy on that machine's disk, none in the
  bucket.
- Added elsewhere (or with ``--bucket``): stored in the models bucket, once however many models
  or adds name it; an object never changes under a ``ModelAdded`` that names it.

A runner that lacks a file asks the nodes first (any node that holds it, the one that fetched
it included, answers) and takes it from the first that offers it; else from the bucket.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo

from bus.stores.object_fetch import fetch_file
from bus.stores.object_store import DigestMismatch, digest_hex, object_info, put_file
from bus.streams import MODELS_BUCKET
from events.catalogue import WeightFile
from modelfiles.shard_files import SAFETENSORS_INDEX, gguf_entry, needed_files, split_parts
from services.models.peer_fetch import PeerFetchError, fetch_from_peer
from services.models.weight_offers import ask_for_offer
from services.models.weights_cache import WeightsCache, sha256_of

log = logging.getLogger(__name__)

# Bytes done and bytes in all, for a whole set of files.
Progress = Callable[[int, int], None]

# How long a runner waits for a node to offer files: briefly when the bucket has them too; a
# while when only a node can give them (it may be reconnecting to NATS).
PEER_ANSWER_S = 0.5
HOLDER_WAIT_S = 10.0


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
    put: bool = True,
) -> list[WeightFile]:
    """Store each ``(name, path)`` in the models bucket unless an object of the same content
    is there already (``put=False``: not at all; a worker's ``cache`` serves them). With
    ``cache``, each file also becomes a blob of that cache (a link to it, not a copy), so that
    a worker sharing it neither fetches what is on its disk nor lacks what it is to serve."""
    if not put and cache is None:
        raise ValueError("files kept out of the bucket need a worker's cache to serve them")
    hashed: list[tuple[str, Path, str]] = []
    for name, path in files:
        hashed.append((name, path, await asyncio.to_thread(sha256_of, path)))
    total = sum(p.stat().st_size for _, p, _ in hashed)
    done = 0
    out: list[WeightFile] = []
    for name, path, sha in hashed:
        size = path.stat().st_size
        weight = WeightFile(name=name, object=object_name(sha), size=size, sha256=sha)
        held = await object_info(js, MODELS_BUCKET, weight.object) if put else None
        if put and (held is None or held.size != size or _hex(held) != sha):
            base = done

            def progress(n: int, base: int = base) -> None:
                if on_progress is not None:
                    on_progress(base + n, total)

            # Another add storing the same file at once makes no second copy (put_file).
            await put_file(
                js,
                MODELS_BUCKET,
                weight.object,
                path,
                description=name,
                on_progress=progress,
                sha256=sha,
            )
        done += size
        if on_progress is not None:
            on_progress(done, total)
        # A copy the cache fetched earlier becomes a link too: a link costs the cache's budget
        # nothing and is never evicted, and this file is the one its worker now gives out.
        if cache is not None and not (cache.holds(weight) and cache.blob(sha).is_symlink()):
            cache.adopt(path, weight)
        out.append(weight)
    return out


def _hex(info: ObjectInfo) -> str | None:
    try:
        return digest_hex(info.digest or "")
    except ValueError:
        return None


async def fetch_files(
    nc: Client,
    cache: WeightsCache,
    files: list[WeightFile],
    on_progress: Progress | None = None,
    *,
    node_id: str = "",
) -> None:
    """Make ``cache`` (node ``node_id``'s) hold every one of ``files``: those it lacks are taken
    from another node that holds them, else from the bucket; resumed where an earlier fetch
    stopped, digest checked. Progress counts the bytes of the files fetched, not of those
    already here."""
    js = nc.jetstream()
    missing = [f for f in files if not cache.holds(f)]
    total = sum(f.size for f in missing)
    done = 0

    def progress_from(base: int) -> Callable[[int], None]:
        def progress(n: int) -> None:
            if on_progress is not None:
                on_progress(base + n, total)

        return progress

    def fetched(f: WeightFile) -> None:
        nonlocal done
        done += f.size
        if on_progress is not None:
            on_progress(done, total)

    stored = {f.sha256: await _stored(js, f) for f in missing}
    left = list(missing)
    while left:
        within = PEER_ANSWER_S if all(stored[f.sha256] for f in left) else HOLDER_WAIT_S
        offer = await ask_for_offer(nc, node_id, left, within)
        offered = [f for f in left if offer is not None and f.sha256 in offer.sha256s]
        if offer is None or not offered:
            break
        failed = 0
        for f in offered:
            async with cache.lock(f.sha256):
                if not cache.holds(f):  # another runner of this node may have fetched it
                    log.info(
                        "fetching %s (%d bytes) from node %s at %s",
                        f.name,
                        f.size,
                        offer.node_id,
                        offer.url,
                    )
                    target, progress = cache.blob(f.sha256), progress_from(done)
                    try:
                        await asyncio.to_thread(fetch_from_peer, offer, f, target, progress)
                    except (PeerFetchError, DigestMismatch) as exc:
                        log.warning("%s; trying elsewhere", exc)
                        failed += 1
                        continue
            fetched(f)
            left.remove(f)
        if failed:
            break  # the node that offered them could not give them: the bucket, if it has them
    for f in left:
        async with cache.lock(f.sha256):
            if not cache.holds(f):
                info = stored[f.sha256]
                if info is None:
                    raise WeightsUnavailable(
                        f"{f.name}: no node that holds it answered within {HOLDER_WAIT_S:.0f} s,"
                        f" and the {MODELS_BUCKET} bucket has no copy: start the node the model"
                        " was added on, or add it again with `shoal models add` (--bucket keeps"
                        " a copy in the bucket)"
                    )
                log.info("fetching %s (%d bytes) from %s", f.name, f.size, MODELS_BUCKET)
                target, progress = cache.blob(f.sha256), progress_from(done)
                await fetch_file(js, MODELS_BUCKET, info, target, on_progress=progress)
        fetched(f)


async def _stored(js: JetStreamContext, f: WeightFile) -> ObjectInfo | None:
    """The bucket's object for ``f``, or None when it has none; an object of another digest or
    size is an error (the bucket's names are digests: something is badly wrong)."""
    info = await object_info(js, MODELS_BUCKET, f.object)
    if info is not None and (_hex(info) != f.sha256 or info.size != f.size):
        raise WeightsUnavailable(
            f"{f.name}: object {f.object} in {MODELS_BUCKET} is not the file the"
            " model names (another digest or size)"
        )
    return info


async def shard_model_path(
    nc: Client,
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
    node_id: str = "",
) -> Path:
    """What a shard's engine is given, with the files it needs in the cache: the model's
    directory (MLX) or its GGUF file (the first part of a split one)."""
    weight_map = None
    if engine == "mlx":
        index = [f for f in files if f.name == SAFETENSORS_INDEX]
        await fetch_files(nc, cache, index, node_id=node_id)
        if index:
            cache.link(model_id, index)
            text = (cache.model_dir(model_id) / SAFETENSORS_INDEX).read_text()
            weight_map = json.loads(text).get("weight_map")
    wanted = needed_files(files, engine, rank, start, end, n_layers, weight_map)
    await fetch_files(nc, cache, wanted, on_progress, node_id=node_id)
    directory = cache.link(model_id, wanted)
    if engine in ("mlx", "diffusers"):
        return directory
    return directory / gguf_entry(files).name
