"""The MLX engines' prompt cache: the KV caches of generations that ended, kept by the tokens
they hold (mlx-lm's ``LRUPromptCache``, as mlx-lm's own server keeps them), so that a prompt
that begins like one of them (a conversation's next turn, a shared system prompt) runs only
what differs.

At most ``size`` caches are kept (the engine's slots: placement budgeted a whole context for
each), the least recently used going first. A cache handed out is a copy: what is kept stays
as it was for the next prompt.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

_MODEL = "model"  # one engine, one model: the key mlx-lm's cache files entries under


class PromptCaches:
    """The kept caches of one engine's model; safe to call from any thread."""

    def __init__(self, model: Module, size: int) -> None:
        self._model = model
        self._size = size
        self._lock = threading.Lock()
        self._lru = LRUPromptCache(max_size=size)

    def __len__(self) -> int:
        return len(self._lru)

    def take(self, prompt: list[int]) -> tuple[list[Any], int]:
        """A cache to run ``prompt`` on and how many of its first tokens it holds already:
        never the last one, whose logits start the generation (a fresh cache holding none when
        nothing kept begins like the prompt)."""
        with self._lock:
            cache, rest = self._lru.fetch_nearest_cache(_MODEL, prompt)
        if cache is not None and not rest:  # all of it: the last token is run again
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            else:
                cache = None
        if cache is None:
            return make_prompt_cache(self._model), 0
        return cache, len(prompt) - len(rest)

    def keep(self, tokens: list[int], cache: list[Any]) -> None:
        """``cache``, holding ``tokens``, for a later prompt that begins like them; evaluated
        here, so that another thread can use it."""
        if not tokens:
            return
        mx.eval([c.state for c in cache])
        with self._lock:
            self._lru.insert_cache(_MODEL, list(tokens), cache)

    def clear(self) -> None:
        with self._lock:
            self._lru = LRUPromptCache(max_size=self._size)
