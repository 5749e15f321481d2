"""The MLX engine with one slot (or a model whose caches mlx-lm cannot batch): one forward pass
per token, as mlx-lm's ``generate_step``, on the shared loop's thread (``batch_loop``) like every
engine's steps. A step is one item of the generation: the first runs the prompt (in chunks, a
task told to stop ending within one), each further one a token. A prompt starts from the longest
prefix the engine's prompt cache holds (not a scored one), and the cache is kept for a later
prompt unless the generation failed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import make_prompt_cache

from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token
from inference.engines.batch_loop import BatchLoop, Generation, Item, max_new
from inference.engines.mlx.prompt_cache import PromptCaches
from inference.engines.mlx.sampling import Picker, as_tokens, prompt_scores
from inference.engines.mlx.vision import MlxVision, text_ids

log = logging.getLogger(__name__)


# The prompt but its last token is run through the model in chunks of this many tokens, and
# the last token alone, as mlx-lm's generate_step does (prefill_step_size): a long prompt's
# attention scores stay small, and greedy output is bit for bit mlx-lm's.
PREFILL_STEP = 512


def prefill_chunks(prompt: list[int]) -> list[list[int]]:
    """The prompt in the pieces the model runs: chunks of everything but the last token, then
    the last token (whose logits give the first generated token)."""
    body = prompt[:-1]
    return [body[i : i + PREFILL_STEP] for i in range(0, len(body), PREFILL_STEP)] + [prompt[-1:]]


@dataclass(eq=False)
class _Run(Generation):
    picker: Picker | None = None
    items: Generator[Item] | None = None  # made at admission, on the loop's thread


class MlxSingleDecoder(BatchLoop[_Run]):
    """Decodes the generations of ``model`` one forward pass each at a time, each with
    ``n_ctx`` of context and its own cache. The runner gives it one task at a time (its one
    slot); generations pulled at once (a test holding one while it runs another) are not held
    back for a slot, as none shares another's state: a step makes one item of each in turn."""

    parks = True  # an MLX thread (see ``BatchLoop.close``)

    def __init__(self, model: Module, *, n_ctx: int, vision: MlxVision | None = None) -> None:
        self._model = model
        self.n_ctx = n_ctx
        self._vision = vision
        self._kept = PromptCaches(model, 1)
        self.prompt_cache = self._kept
        super().__init__(sys.maxsize, "mlx-single")

    def run(self, prompt: list[int], decoding: Decoding, picker: Picker, sink: Sink) -> _Run:
        """The generation to push or pull."""
        n = max_new(prompt, decoding, self.n_ctx)
        return _Run(list(prompt), decoding, n, sink, picker=picker)

    # --- the loop's thread ---------------------------------------------------------------------

    def _admit(self, run: _Run) -> None:
        assert run.picker is not None
        run.items = self._generate(run.prompt, run.decoding, run.picker)

    def _forget(self, run: _Run) -> None:
        if run.items is not None:
            run.items.close()  # its cache is kept (the generator's ``finally``)
            run.items = None

    def _step(self, ready: list[_Run]) -> None:
        for run in ready:
            assert run.items is not None
            try:
                item = next(run.items)
            except StopIteration:
                run.end()
                continue
            except Exception as exc:  # this generation's alone
                run.items = None  # failed: its cache is not kept
                run.end(exc)
                continue
            if not run.emit(item):
                continue
            if run.given >= run.max_new and isinstance(item, Token | PromptScores):
                run.end()  # (a scored prompt with no token asked ends with its scores)

    def _discard(self) -> None:
        self._kept.clear()

    def _generate(self, prompt: list[int], decoding: Decoding, picker: Picker) -> Generator[Item]:
        """Lazy: the prompt is processed at the first ``next()``, and each further token costs
        one ``next()``. The cache is kept for a later prompt unless the generation failed."""
        if decoding.echo:
            cache, cached = make_prompt_cache(self._model), 0
        else:
            cache, cached = self._kept.take(prompt)
            if cached:
                yield PromptCached(cached)
        fed = prompt[:cached]  # what the cache holds
        failed = False
        try:
            yield from self._run_prompt(prompt, cached, decoding, picker, cache, fed)
        except Exception:
            failed = True
            raise
        finally:
            if not failed:
                self._kept.keep(fed, cache)

    def _run_prompt(
        self,
        prompt: list[int],
        cached: int,
        decoding: Decoding,
        picker: Picker,
        cache: list[Any],
        fed: list[int],
    ) -> Iterator[Token | PromptScores]:
        """One forward pass per token after the prompt's chunks from ``cached`` on; ``fed``
        grows by what each pass adds to ``cache``."""
        model = self._model
        *body, last = prefill_chunks(prompt[cached:])
        scored = [Token(prompt[0])]
        done = 0
        for chunk in body:
            if decoding.stop_asked():  # told to stop: within one chunk, not at the prompt's end
                return
            if decoding.images:
                assert self._vision is not None
                at = cached + done
                rows = self._vision.embeddings(prompt, decoding.images, at, at + len(chunk))
                logits = model(mx.array([text_ids(chunk)]), cache=cache, input_embeddings=rows)
            else:
                logits = model(mx.array([chunk]), cache=cache)
            if decoding.echo:
                # Each position's logits score the prompt's next token (the lm head runs on
                # every position only here: otherwise only the cache is evaluated).
                targets = prompt[done + 1 : done + len(chunk) + 1]
                scored += as_tokens(*prompt_scores(logits[0], targets, decoding.top_logprobs or 0))
            mx.eval([c.state for c in cache])
            fed += chunk
            done += len(chunk)
        if decoding.echo:
            yield PromptScores(tuple(scored))
        step = last
        position = len(prompt)
        while True:
            logits = model(mx.array([step]), cache=cache)[:, -1, :]
            fed += step
            token = picker.pick(logits)
            yield token
            position += 1
            if position >= self.n_ctx:
                return
            step = [token.id]
