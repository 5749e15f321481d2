"""The cluster API's request bodies."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from api.body import Count, RequestBody
from events.kinds import DEFAULT_KV_CACHE, InstanceRole, KvCacheRequest
from events.records import Speculative
from services.models.footprint import MAX_SLOTS


class InstanceRequest(RequestBody):
    model: Annotated[str, Field(min_length=1)]
    placement: str | dict[str, object] | None = Field(
        default=None, description="A placement spec, as JSON text or as an object."
    )
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    context_length: Count | None = None
    slots: Annotated[int, Field(ge=1, le=MAX_SLOTS, strict=True)] | None = Field(
        default=None,
        description="Tasks each replica serves at once, each with a KV cache of the whole"
        " context; default: as many as fit, up to 8.",
    )
    kv_cache: KvCacheRequest = Field(
        default=DEFAULT_KV_CACHE,
        description="The KV cache's type: f16, q8_0 (about half of f16's memory), q4_0 (about"
        " a quarter), or auto (f16, else the smallest that lets the context fit). The llama.cpp"
        " engine's chat instances; others keep f16.",
    )
    speculative: Speculative | None = Field(
        default=None,
        description='Speculative decoding for its runners: prompt lookup, {"type": "ngram",'
        ' "draft_max": 16, "ngram_min": 2, "ngram_max": 4}; the tokens are the same,'
        " sooner where the answer repeats its context. The llama.cpp engine's chat instances.",
    )
    queue: bool = Field(default=False, description="Request it even if it cannot be placed now.")
    aliases: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=32)
    ] = Field(default_factory=list, description="Other names clients may call the model by.")
    role: InstanceRole | None = Field(
        default=None,
        description="What the instance serves: 'chat' (generation) or 'embed' (embeddings);"
        " default: the placement's one role, else chat.",
    )
