"""Which KV-cache types an instance may have and which placement tries (pure): the one asked
for, or for ``auto`` f16 then the smaller ones; f16 only where nothing else is kept (the MLX
engine; embed and rerank runners)."""

from __future__ import annotations

from events.kinds import (
    DEFAULT_KV_CACHE,
    KV_CACHE_TYPES,
    Engine,
    InstanceRole,
    KvCacheRequest,
    KvCacheType,
)


def _f16_only(engine: Engine, role: InstanceRole) -> str | None:
    """What keeps its KV cache in f16 only, or None: the MLX engine, and embed and rerank
    runners (whose contexts are made apart, for one batch of inputs)."""
    if engine == "mlx":
        return "the mlx engine keeps its KV cache in f16 only"
    if engine == "diffusers":
        return "an image model keeps no KV cache"
    if role != "chat":
        article = "an" if role[0] in "aeiou" else "a"
        return f"{article} {role} instance keeps its KV cache in f16 only"
    return None


def kv_cache_problem(engine: Engine, role: InstanceRole, kv_cache: KvCacheRequest) -> str | None:
    """Why an instance on ``engine`` cannot have a KV cache of ``kv_cache`` type, or None."""
    only = _f16_only(engine, role)
    if only is not None and kv_cache not in (DEFAULT_KV_CACHE, "auto"):
        return f"kv_cache {kv_cache}: {only}; ask for f16 or auto"
    return None


def kv_cache_candidates(
    engine: Engine,
    role: InstanceRole,
    kv_cache: KvCacheRequest,
    current: KvCacheType | None = None,
) -> tuple[KvCacheType, ...]:
    """The KV-cache types to try, in order: the one asked for; for ``auto`` f16, then the
    smaller ones (the type the runners use now first, when placing again); f16 only where
    nothing else is kept (``_f16_only``)."""
    if kv_cache != "auto":
        return (kv_cache,)
    if _f16_only(engine, role) is not None:
        return (DEFAULT_KV_CACHE,)
    order = KV_CACHE_TYPES
    if current is not None:
        order = (current, *(t for t in order if t != current))
    return order
