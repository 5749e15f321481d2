"""Continuous batching for the MLX engine, through mlx-lm's own ``BatchGenerator``: one forward
pass per step for every sequence in flight, prompts prefilled beside the others' decoding.

Generations are admitted between steps, up to ``slots`` at once; each is inserted with its own
sampler and logits processor (``SequencePicker``: the task's penalties, logit bias, grammar,
temperature, filters and random key, as ``mlx_sampling.Picker`` picks for one), its
``max_tokens`` (what the request and the context leave room for) and the model's end tokens as
its stops. mlx-lm's prefill keeps no logits of the prompt and reads only tokens, so a prompt
that is scored (echo) or has images (their embeddings: ``vision.py``) is run here, a chunk a
step beside the others, and inserted with the cache it made. A prompt starts from the longest
prefix the engine's prompt cache holds (``mlx_prompt_cache``; not a scored one), and a
sequence's cache is kept there when it ends or is let go.

The decoding runs on the shared loop (``batch_loop``: admission, the sinks, a freed slot, a
prefill told to stop). A sequence's error (a grammar it cannot follow) ends it alone; a failed
step ends the sequences that were in it, and the next step starts a fresh ``BatchGenerator``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token
from inference.engines.batch_loop import BatchLoop, Generation, Item, max_new
from inference.engines.mlx.prompt_cache import PromptCaches
from inference.engines.mlx.sampling import (
    Constraint,
    as_tokens,
    draw,
    penalty_processors,
    prompt_scores,
    scored,
)
from inference.engines.mlx.vision import MlxVision, text_ids

log = logging.getLogger(__name__)


def batchable(model: Module) -> bool:
    """Whether mlx-lm can batch the model: every cache of its layers can be merged into a
    batch's (a model with another kind of cache decodes one task at a time)."""
    return all(hasattr(type(c), "merge") for c in make_prompt_cache(model))


class SequencePicker:
    """One sequence's picking, as ``BatchGenerator`` runs it: ``process`` is its logits
    processor (the logit bias and penalties over the generated tokens, then the grammar's
    mask; in float32, whatever the sequences beside it), ``sample`` its sampler (greedy at
    temperature 0, else top_k, top_p, min_p and a draw with its own key: the same seed gives
    the same tokens). Made on the decoding thread.

    The generator computes each step's next token before it hands over the last one (the next
    forward pass overlaps the reading), so the grammar learns a token at the next token's
    ``process``, which waits for it (a grammar's batch loses that overlap). Nothing here raises
    into the generator's step, which would break every sequence's: a failure is kept, and
    ``token`` raises it for the first token that cannot be given.

    A forced token (``Decoding.forced``: a thinking budget's closing tag) is ``sample``'s pick,
    unless the processed logits rule it out (the grammar's mask). The generator runs ahead of
    the consumer that forces it (the step under way, and the tokens a consumer may lag), so the
    thinking goes a token or a few over its budget."""

    def __init__(
        self,
        decoding: Decoding,
        seed: int,
        n_vocab: int,
        prompt_len: int,
        constraint: Constraint | None,
    ) -> None:
        self._params = decoding.params
        self._n_vocab = n_vocab
        self._top_logprobs = decoding.top_logprobs
        self._key = mx.random.key(seed % 2**64)
        self._processors = penalty_processors(decoding.params)
        self._prompt_len = prompt_len  # the context's tokens before the generated ones
        self._constraint = constraint
        self._forced = decoding.forced
        self._calls = 0
        self._picked: deque[mx.array] = deque()  # a grammar's: picked, not yet accepted
        self._raw: deque[mx.array] = deque()  # with logprobs: each token's raw logits
        self._error: Exception | None = None
        self._error_at = 0  # the first token that cannot be given

    def process(self, context: mx.array, logits: mx.array) -> mx.array:
        """``context``: the prompt and the tokens generated so far; ``logits``: (1, vocab)."""
        n = self._calls
        self._calls += 1
        if self._top_logprobs is not None:
            self._raw.append(logits)
        x = logits.astype(mx.float32)
        if self._error is not None:
            return x
        if self._processors:
            generated = context[self._prompt_len :]
            for processor in self._processors:
                x = processor(generated, x)
        if self._constraint is None:
            return x
        at = n - 1
        try:
            if n > 0:
                self._constraint.accept(int(np.array(self._picked.popleft())[0]))
            at = n
            allowed = self._constraint.allowed()
        except Exception as exc:  # this sequence's alone
            self._error, self._error_at = exc, at
            return x
        return x if allowed is None else mx.where(mx.array(allowed), x, -math.inf)

    def sample(self, logprobs: mx.array) -> mx.array:
        forced = self._forced.next()
        if forced is not None and self._error is None and bool(logprobs[0, forced] > -math.inf):
            choice = mx.array([forced], dtype=mx.uint32)
        else:
            if forced is not None:
                self._forced.clear()
            key = None
            if self._params.temperature != 0:
                self._key, key = mx.random.split(self._key)
            choice = draw(logprobs, self._params, self._n_vocab, key)
        if self._constraint is not None:
            self._picked.append(choice)
        return choice

    def token(self, index: int, token: int) -> Token:
        """The sequence's token ``index`` (from 0), as given to its consumer; raises the
        sequence's failure instead where it cannot be given."""
        if self._error is not None and index >= self._error_at:
            raise self._error
        if self._top_logprobs is None:
            return Token(token)
        return scored(self._raw.popleft(), token, self._top_logprobs)


@dataclass
class _Prefill:
    """A prompt run here rather than by the generator (one that is scored, one with images):
    its cache, how far, and, for a scored one, the scores so far."""

    cache: list[Any]
    done: int = 0
    scores: list[Token] | None = None


@dataclass(eq=False)
class _Sequence(Generation):
    make_picker: Callable[[], SequencePicker] | None = None
    picker: SequencePicker | None = None
    uid: int | None = None  # in the BatchGenerator
    prefill: _Prefill | None = None


class MlxBatchDecoder(BatchLoop[_Sequence]):
    """Decodes up to ``slots`` generations of ``model`` together (see the module's doc); each
    has ``n_ctx`` of context, and stops at one of ``ends``."""

    # The generator computes a step's next token before it hands over the last one.
    lookahead = 2
    parks = True  # an MLX thread (see ``BatchLoop.close``)

    def __init__(
        self,
        model: Module,
        *,
        slots: int,
        n_ctx: int,
        ends: Sequence[int],
        prefill_step: int,
        vision: MlxVision | None = None,
    ) -> None:
        self._model = model
        self._vision = vision
        self.n_ctx = n_ctx
        self._ends = [[int(t)] for t in ends]
        self._prefill_step = prefill_step
        self._by_uid: dict[int, _Sequence] = {}
        self._generator: BatchGenerator | None = None
        self._kept = PromptCaches(model, slots)
        self.prompt_cache = self._kept
        super().__init__(slots, "mlx-batch")

    def generate(
        self, prompt: list[int], decoding: Decoding, make_picker: Callable[[], SequencePicker]
    ) -> Generator[Item]:
        """As a Python generator on the caller's thread (nothing is admitted before the first
        ``next()``)."""
        return self.pull(lambda sink: self.sequence(prompt, decoding, make_picker, sink))

    def submit(
        self,
        prompt: list[int],
        decoding: Decoding,
        make_picker: Callable[[], SequencePicker],
        sink: Sink,
    ) -> None:
        """Its items into ``sink``, on the decoding thread."""
        self.push(self.sequence(prompt, decoding, make_picker, sink))

    def sequence(
        self,
        prompt: list[int],
        decoding: Decoding,
        make_picker: Callable[[], SequencePicker],
        sink: Sink,
    ) -> _Sequence:
        n = max_new(prompt, decoding, self.n_ctx)
        return _Sequence(list(prompt), decoding, n, sink, make_picker=make_picker)

    # --- the decoding thread ---------------------------------------------------------------------

    def _discard(self) -> None:
        self._by_uid.clear()
        self._kept.clear()
        if self._generator is not None:
            with contextlib.suppress(Exception):
                self._generator.close()  # type: ignore[no-untyped-call]
            self._generator = None  # its caches are freed here, on this thread

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._model,
            stop_tokens=self._ends,
            completion_batch_size=self.slots,
            prefill_batch_size=self.slots,
            prefill_step_size=self._prefill_step,
        )

    def _forget(self, seq: _Sequence) -> None:
        """Out of the generator, if it is still there; its cache is kept for a later prompt."""
        if seq.uid is not None:
            assert self._generator is not None
            removed = self._generator.remove([seq.uid], return_prompt_caches=True)  # type: ignore[no-untyped-call]
            for cache, tokens in removed.values():
                self._kept.keep(tokens, cache)
            del self._by_uid[seq.uid]
            seq.uid = None

    def _admit(self, seq: _Sequence) -> None:
        assert seq.make_picker is not None
        seq.picker = seq.make_picker()
        if seq.decoding.echo:
            cache = make_prompt_cache(self._model)
            seq.prefill = _Prefill(cache, scores=[Token(seq.prompt[0])])
            return
        cache, cached = self._kept.take(seq.prompt)
        if cached:
            seq.emit(PromptCached(cached))
        if seq.decoding.images:  # the images' embeddings go in here, not through the generator
            seq.prefill = _Prefill(cache, done=cached)
        else:
            self._insert(seq, seq.prompt[cached:], cache, seq.prompt[:cached])

    def _insert(
        self,
        seq: _Sequence,
        prompt: list[int],
        cache: list[Any] | None = None,
        cached: list[int] | None = None,
    ) -> None:
        """Into the generator: ``prompt`` to run, after what ``cache`` holds (``cached``)."""
        if self._generator is None:
            self._generator = self._new_generator()
        assert seq.picker is not None
        (uid,) = self._generator.insert(
            [prompt],
            max_tokens=[seq.max_new],
            caches=None if cache is None else [cache],
            all_tokens=None if cached is None else [list(cached)],
            samplers=[seq.picker.sample],
            logits_processors=[[seq.picker.process]],
        )
        seq.uid = uid
        self._by_uid[uid] = seq

    def _step(self, ready: list[_Sequence]) -> None:
        """Every sequence in the generator is stepped (the batch is one forward pass), and the
        oldest prompt run here gets a chunk."""
        running = next((s for s in self._active if s.prefill is not None and s.live()), None)
        if running is not None:
            try:
                self._prefill(running)
            except Exception as exc:  # this prompt's alone
                log.exception("running a prompt failed")
                running.end(exc)
        if not self._by_uid:
            return
        assert self._generator is not None
        try:
            _, responses = self._generator.next()  # type: ignore[no-untyped-call]
        except Exception as exc:  # a failed step ends the sequences that were in it
            log.exception("a batch of %d sequences failed", len(self._by_uid))
            for seq in self._by_uid.values():
                seq.uid = None
                seq.end(exc)
            self._by_uid.clear()
            self._generator.close()  # type: ignore[no-untyped-call]
            self._generator = self._new_generator()
            return
        for response in responses:
            to = self._by_uid.get(response.uid)
            if to is None:
                continue
            assert to.picker is not None
            try:
                token = to.picker.token(to.given, int(response.token))
            except Exception as exc:  # this sequence's alone (a grammar it cannot follow)
                self._forget(to)
                to.end(exc)
                continue
            to.emit(token)  # one that wants no more leaves the generator at the next step
            if response.finish_reason is not None:  # an end token, or max_new made
                del self._by_uid[response.uid]
                to.uid = None
                to.end()
                self._kept.keep(response.all_tokens, response.prompt_cache)

    def _prefill(self, seq: _Sequence) -> None:
        """A chunk of a prompt run here: a scored one's tokens each given the ones before it,
        from the logits of the position before it (the first has none); one with images with
        their embeddings in place of the image tokens'. Once all is run, a scored prompt's
        scores go out, and its generation is inserted with the cache."""
        run = seq.prefill
        assert run is not None
        prompt, body = seq.prompt, seq.prompt[:-1]
        chunk = body[run.done : run.done + self._prefill_step]
        if chunk:
            images = seq.decoding.images
            if images:
                assert self._vision is not None
                rows = self._vision.embeddings(prompt, images, run.done, run.done + len(chunk))
                logits = self._model(
                    mx.array([text_ids(chunk)]), cache=run.cache, input_embeddings=rows
                )
            else:
                logits = self._model(mx.array([chunk]), cache=run.cache)
            if run.scores is not None:
                targets = prompt[run.done + 1 : run.done + len(chunk) + 1]
                k = seq.decoding.top_logprobs or 0
                run.scores += as_tokens(*prompt_scores(logits[0], targets, k))
            # Only the cache is evaluated: the logits of a prompt not scored are never made.
            mx.eval([c.state for c in run.cache])
            run.done += len(chunk)
        if run.done < len(body):
            return
        seq.prefill = None
        if run.scores is not None and not seq.emit(PromptScores(tuple(run.scores))):
            return
        if seq.max_new > 0:
            self._insert(seq, prompt[-1:], run.cache, body)
        else:
            seq.end()
