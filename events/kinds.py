"""Kinds of things the log names that are not states: the engines a model runs on, the roles
an instance serves and the roles of API keys. Written once, here, as ``Literal`` types, so that
a misspelt kind is a type error wherever it is used (``events/states.py`` is the same for states
and statuses)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeGuard, get_args

# diffusers: an image model's (a diffusers pipeline directory), served by the image runner.
Engine = Literal["llamacpp", "mlx", "diffusers"]
ENGINES: tuple[Engine, ...] = get_args(Engine)
DEFAULT_ENGINE: Engine = "llamacpp"

# What an instance serves: generation (chat and completions), embeddings, or relevance scores
# of documents to a query (a reranker's).
InstanceRole = Literal["chat", "embed", "rerank"]
INSTANCE_ROLES: tuple[InstanceRole, ...] = get_args(InstanceRole)
DEFAULT_ROLE: InstanceRole = "chat"


# The type of an instance's KV cache, as llama.cpp names it (llama-server's ``-ctk/-ctv``,
# Ollama's ``OLLAMA_KV_CACHE_TYPE``): f16 is 2 bytes an element, q8_0 34 bytes and q4_0 18
# bytes a block of 32 (about a half and a quarter of f16's). A request may also say ``auto``:
# placement picks f16, else the smallest quantized type that lets the context fit.
KvCacheType = Literal["f16", "q8_0", "q4_0"]
KV_CACHE_TYPES: tuple[KvCacheType, ...] = get_args(KvCacheType)
DEFAULT_KV_CACHE: KvCacheType = "f16"
KvCacheRequest = Literal["f16", "q8_0", "q4_0", "auto"]
KV_CACHE_REQUESTS: tuple[KvCacheRequest, ...] = get_args(KvCacheRequest)


def is_kv_cache_request(value: object) -> TypeGuard[KvCacheRequest]:
    return value in KV_CACHE_REQUESTS


# What an API key may do: ``user`` keys run inference and see only what they made; ``admin``
# keys manage the cluster (instances, models, keys) and read its events.
KeyRole = Literal["admin", "user"]
KEY_ROLES: tuple[KeyRole, ...] = get_args(KeyRole)


def is_engine(value: str) -> TypeGuard[Engine]:
    return value in ENGINES


def is_role(value: str) -> TypeGuard[InstanceRole]:
    return value in INSTANCE_ROLES


def role_of_task(kind: str) -> InstanceRole:
    """The role of the instances that serve a task of ``kind`` (a task row's): embeddings and
    reranking each their own, every other kind (chat, completion) generation."""
    if kind == "embedding":
        return "embed"
    if kind == "rerank":
        return "rerank"
    return "chat"


def makes_images(engines: Sequence[str] | None) -> bool:
    """Whether a model of these engines makes images (its tasks are of kind ``image``)."""
    return main_engine(engines) == "diffusers"


def main_engine(engines: Sequence[str] | None) -> Engine:
    """The engine a model runs on: the first it names (a model row or an event from before
    engines were named: llama.cpp)."""
    first = engines[0] if engines else DEFAULT_ENGINE
    return first if is_engine(first) else DEFAULT_ENGINE
