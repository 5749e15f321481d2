"""A node's weights cache has a size budget (``shoal worker --cache-size``): when what its
runners are about to fetch would take the cache over it, the models no runner of the node uses
are evicted, least recently used first. Pure: the budget's parsing, and the choice of what to
evict from a picture of the cache; the worker does the file operations
(``services/worker/cache_upkeep.py``).

What counts is the cache's own copies (blobs fetched from another node or the bucket). A blob
that is a link to a file already on this machine (what ``shoal models add`` adopted, a
package's file) costs nothing and is never evicted: the file is the user's, and the link is
how this node gives it to others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bus.streams import parse_size

# Half of the filesystem that holds the cache, whatever its size: room for models, and as
# much again for everything else on that disk.
DEFAULT_CACHE_FRACTION = 0.5


@dataclass(frozen=True)
class CacheSize:
    """``--cache-size``: a number of bytes, a fraction of the filesystem's total size, or
    neither (no budget)."""

    bytes: int | None = None
    fraction: float | None = None

    def budget(self, disk_total: int) -> int | None:
        """The budget in bytes on a filesystem of ``disk_total`` bytes (None: no budget)."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return int(disk_total * self.fraction)
        return None

    def __str__(self) -> str:
        if self.bytes is not None:
            return f"{self.bytes} bytes"
        if self.fraction is not None:
            return f"{self.fraction * 100:g}% of the disk"
        return "no limit"


DEFAULT_CACHE_SIZE = CacheSize(fraction=DEFAULT_CACHE_FRACTION)


def parse_cache_size(text: str) -> CacheSize:
    """'50%' (of the filesystem's total size), '200G', '512M', bytes; '-1': no budget."""
    t = text.strip()
    if t.endswith("%"):
        try:
            percent = float(t[:-1])
        except ValueError:
            raise ValueError(f"{text!r}: expected a percentage such as 50%") from None
        if not 0 < percent <= 100:
            raise ValueError(f"{text!r}: a percentage of the disk is above 0 and at most 100")
        return CacheSize(fraction=percent / 100)
    value = parse_size(t)
    return CacheSize() if value < 0 else CacheSize(bytes=value)


@dataclass(frozen=True)
class CachedModel:
    """A model's directory in the cache: the blobs it links to (by SHA-256), when a runner of
    this node last used it (seconds, any clock), and whether one uses it now."""

    name: str
    blobs: frozenset[str]
    last_used: float
    in_use: bool = False


@dataclass(frozen=True)
class Eviction:
    """What to delete: the models (with the bytes each frees), the blobs, and the bytes the
    cache still holds beyond its budget once the fetch is done (0: it fits)."""

    models: tuple[tuple[str, int], ...] = ()
    blobs: frozenset[str] = frozenset()
    orphan_bytes: int = 0  # freed by copies no model's directory links to
    over_by: int = 0

    @property
    def freed(self) -> int:
        return self.orphan_bytes + sum(n for _, n in self.models)


def choose_evictions(
    models: Sequence[CachedModel],
    blob_bytes: Mapping[str, int],
    budget: int,
    needed: int,
    keep: frozenset[str] = frozenset(),
) -> Eviction:
    """What to evict so that the cache's blobs (``blob_bytes``: what each costs, 0 for a link)
    and ``needed`` more bytes fit in ``budget``: first the copies no model's directory links
    to, then the models no runner uses, least recently used first, until it fits (or nothing
    evictable is left: ``over_by`` says by how much it does not). A blob in ``keep`` (what the
    node's runners need), or linked by a model that stays, is never deleted; a model that
    could free nothing (links only, or copies a runner needs) is left alone."""
    over = sum(blob_bytes.values()) + needed - budget
    if over <= 0:
        return Eviction()
    linked = {sha for m in models for sha in m.blobs}
    orphans = frozenset(
        sha for sha, n in blob_bytes.items() if n > 0 and sha not in linked and sha not in keep
    )
    orphan_bytes = sum(blob_bytes[sha] for sha in orphans)
    over -= orphan_bytes
    gone: set[str] = set(orphans)
    evicted: list[tuple[str, int]] = []
    staying = {m.name: m for m in models}
    # Blobs that stay whatever is evicted: a model that holds nothing else would free nothing.
    pinned = keep | {sha for m in models if m.in_use for sha in m.blobs}
    candidates = sorted(
        (
            m
            for m in models
            if not m.in_use and any(blob_bytes.get(s, 0) > 0 and s not in pinned for s in m.blobs)
        ),
        key=lambda m: (m.last_used, m.name),
    )
    for model in candidates:
        if over <= 0:
            break
        del staying[model.name]
        still_linked = {sha for m in staying.values() for sha in m.blobs}
        frees = {
            sha
            for sha in model.blobs
            if blob_bytes.get(sha, 0) > 0
            and sha not in still_linked
            and sha not in keep
            and sha not in gone
        }
        freed = sum(blob_bytes[sha] for sha in frees)
        gone |= frees
        over -= freed
        evicted.append((model.name, freed))
    return Eviction(
        models=tuple(evicted),
        blobs=frozenset(gone),
        orphan_bytes=orphan_bytes,
        over_by=max(0, over),
    )


def download_refusal(
    model_id: str, needed: int, free: int, budget: int | None, cached: int = 0
) -> str | None:
    """Why a download of ``needed`` bytes (a model's weights, not yet on disk) cannot start on
    a node whose disk has ``free`` bytes free and whose cache holds ``cached`` bytes of a
    ``budget`` (None: no budget); None when it may. Asked before the first byte is fetched:
    a model larger than the whole budget, or than the free disk, would fill it for nothing."""
    gib = 1024**3
    if budget is not None and needed > budget:
        return (
            f"model `{model_id}` is {needed / gib:.1f} GiB, more than this node's weights cache"
            f" may hold ({budget / gib:.1f} GiB, --cache-size)"
        )
    if needed > free:
        return (
            f"model `{model_id}` is {needed / gib:.1f} GiB, more than the {free / gib:.1f} GiB"
            " free on the disk that would hold it"
        )
    return None
