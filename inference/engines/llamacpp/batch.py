"""Continuous batching for the llama.cpp engine: one ``llama_decode`` per step for every
sequence in flight, as llama.cpp's own server does with its parallel slots.

A context holds ``slots`` sequences (``n_seq_max``; each its own part of the KV cache, the
context promised to one task). It is made for one sequence at first, and for all the slots
when a second generation comes while the first runs (``_grow``: the first is computed again
into the new context): llama.cpp allocates and clears the whole KV cache when it makes a
context, most of a small model's load, so a model loaded for one request (on demand, or
alternating with another) answers it sooner.

Generations are admitted between steps: a new one takes a free slot (the one whose cache
shares the longest prefix with its prompt, so that a conversation's next turn or a shared
system prompt is not computed again: ``pick_slot``), and its prompt goes in chunks beside the
others' next tokens, so that a long prompt holds everyone's next token back by one batch of
``n_batch`` tokens at most. Each sequence has its own sampler
(``SequenceSampler``); a sequence's error (a grammar it cannot follow) ends it alone.

A prompt's images (``Decoding.images``) are evaluated apart, on the decoding thread before a
step, each on its own sequence at its position (``evaluate_image``: the engine's projector), as
llama.cpp's server does: one ``llama_decode`` cannot mix token and embedding rows. A sequence's
text then goes in the shared batch up to its next image at most.

The decoding runs on the shared loop's thread (``batch_loop``: admission, the sinks, a freed
slot, a prefill told to stop), the only one that touches the context; what is llama.cpp's is a
step (``_step``), a slot taken (``_admit``) and let go (``_forget``). Each generation's items
go to its ``Sink`` on that thread (the runner makes its steps there, between two decodes:
``submit``), or to a Python generator on the caller's thread (``generate``). The pure parts
(what goes in a step, which slot a prompt takes) are functions, tested alone
(``batch_plan.py``).

With ``speculative`` (prompt lookup, ``inference/speculative.py``), a decoding sequence's next
token goes in the step with a draft of the tokens that may follow it, each with its logits;
the sequence's sampler then picks each position's token in order, as it would have one step at
a time, and the draft's cells past the first token it did not pick are dropped. The tokens are
those of decoding without it; a step gives a sequence as many as the draft got right, plus one.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import llama_cpp
import numpy as np

from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token
from inference.engines.batch_loop import BatchLoop, Generation, Item, max_new
from inference.engines.llamacpp.batch_plan import Need, pick_slot, plan_step
from inference.engines.llamacpp.sampling import Logits, SequenceSampler, scored
from inference.image_spans import ImageSpan, image_at, kept, position, text_run
from inference.speculative import NgramIndex, NgramLookup, verified

log = logging.getLogger(__name__)

# Evaluates an image chunk into a sequence (the slot) of a context from a position (the
# engine's projector).
EvaluateImage = Callable[[Any, ImageSpan, int, int], None]
# Makes a llama.cpp context for a number of sequences, each with the whole context (the engine).
MakeContext = Callable[[int], Any]

# How long a step waits for the consumers still handling their last token (``straggler_s``).
STRAGGLER_S = 0.02


class Batch:
    """A ``llama_batch``: tokens, each at a position of one sequence, with or without logits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._batch = llama_cpp.llama_batch_init(capacity, 0, 1)
        self.n = 0
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Its index in the batch (what ``llama_get_logits_ith`` takes)."""
        b, i = self._batch, self.n
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        self.n += 1
        return i

    def decode(self, ctx: Any) -> None:
        self._batch.n_tokens = self.n
        status = llama_cpp.llama_decode(ctx, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status})")


@dataclass(eq=False)
class _Sequence(Generation):
    make_sampler: Callable[[], SequenceSampler] | None = None
    slot: int = -1
    sampler: SequenceSampler | None = None
    prefilled: int = 0  # prompt tokens in the cache
    next_token: int | None = None  # sampled, not yet in the cache
    sampled: int = 0
    scores: list[Token] = field(default_factory=list)  # echo: the prompt's, so far
    ngrams: NgramIndex | None = None  # speculative: its prompt and tokens, to draft from
    draft: list[int] = field(default_factory=list)  # this step's, after ``next_token``
    drafted: int = 0  # draft tokens it put in steps
    accepted: int = 0  # of which its sampler picked

    @property
    def prefill_left(self) -> int:
        return len(self.prompt) - self.prefilled

    def prefilling(self) -> bool:
        return self.prefill_left > 0

    @property
    def images(self) -> tuple[ImageSpan, ...]:
        return self.decoding.images

    def text_left(self) -> int:
        """Prompt tokens the shared batch may take next: up to the next image."""
        return text_run(self.images, self.prefilled, len(self.prompt))


class BatchDecoder(BatchLoop[_Sequence]):
    """Decodes the generations of a llama.cpp context together (see the module's doc), and
    owns the context (made by ``make_context``, for one sequence and then for ``slots``; freed
    with the decoder, ``owner`` kept until then)."""

    # A step waits for the consumers still handling their last token (normally microseconds):
    # their work then happens between decodes, not during one, where it would take a core from
    # llama.cpp's threads (which spin-wait); and a sequence left out would wait a whole step.
    # A consumer that is late longer than this is left out of this step.
    straggler_s = STRAGGLER_S

    def __init__(
        self,
        make_context: MakeContext,
        *,
        owner: object,
        slots: int,
        n_vocab: int,
        is_end: Callable[[int], bool],
        evaluate_image: EvaluateImage | None = None,
        speculative: NgramLookup | None = None,
    ) -> None:
        self._make_context = make_context
        self.speculative = speculative
        self.drafted = self.accepted = 0  # draft tokens, all sequences', for the metrics
        self._evaluate_image = evaluate_image
        self._owner = owner  # what holds the model: it must outlive the context
        self._n_vocab = n_vocab
        self._is_end = is_end
        self._use(make_context(1))
        self._capacity = 1  # the sequences the context holds: 1, then ``slots``
        self.n_ctx = int(llama_cpp.llama_n_ctx_seq(self._ctx))  # each slot's
        self._batch = Batch(int(llama_cpp.llama_n_batch(self._ctx)))
        self._slots: dict[int, _Sequence] = {}  # the active ones, by slot
        self._cached: dict[int, list[int]] = {}  # by slot: the tokens its cache holds
        self._last_used: dict[int, float] = {}
        self._dropping = False  # drop the free slots' caches before the next admission
        super().__init__(slots, "llama-batch")

    @property
    def ctx(self) -> Any:
        """The llama.cpp context now (to read, not to decode with: that is the decoder's; a new
        one replaces it when it grows)."""
        return self._ctx

    def close(self) -> None:
        super().close()
        self._free()

    def _use(self, ctx: Any) -> None:
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        # Freed by ``close``, or with the decoder; not at exit, where the decoding thread
        # (a daemon) may still be in it.
        self._free = weakref.finalize(self, llama_cpp.llama_free, ctx)
        self._free.atexit = False

    def _grow(self) -> bool:
        """The context for all the slots in place of the one for a single sequence: the
        sequence in flight there is computed again into the new one (its cells cannot be
        moved: a sequence's saved state names its context's number of streams), the cache an
        idle one kept is dropped. False, and one sequence at a time from then on, if llama.cpp
        cannot make it."""
        try:
            ctx = self._make_context(self.slots)
        except Exception:
            log.exception("no context for %d slots: serving one task at a time", self.slots)
            self.slots = self._capacity
            return False
        old, self._capacity = self._free, self.slots
        self._use(ctx)
        old()
        for slot in list(self._cached):
            seq = self._slots.get(slot)
            if seq is None:
                del self._cached[slot]
                continue
            try:
                self._refill(slot, self._cached[slot], seq.images)
            except Exception as exc:  # this sequence's alone
                log.exception("the sequence in slot %d could not be computed again", slot)
                self._drop(slot)
                seq.end(exc)
        return True

    def _refill(self, slot: int, tokens: list[int], images: tuple[ImageSpan, ...]) -> None:
        """Computes a slot's cached ``tokens`` (with their images) again into the context."""
        done = 0
        while done < len(tokens):
            at = position(images, done)
            if image := image_at(images, done):
                assert self._evaluate_image is not None
                self._evaluate_image(self._ctx, image, slot, at)
                done += image.n_tokens
                continue
            n = min(text_run(images, done, len(tokens)), self._batch.capacity)
            self._batch.clear()
            for i in range(done, done + n):
                self._batch.add(tokens[i], at + i - done, slot, logits=False)
            self._batch.decode(self._ctx)
            done += n

    def drop_cache(self) -> None:
        """Forget what the slots' caches hold: the next prompts run whole."""
        with self._cond:
            self._dropping = True

    def submit(
        self,
        prompt: list[int],
        decoding: Decoding,
        make_sampler: Callable[[], SequenceSampler],
        sink: Sink,
    ) -> None:
        """Decode a generation into ``sink`` (called on the decoding thread), from the first
        free slot."""
        self.push(self._sequence(prompt, decoding, make_sampler, sink))

    def generate(
        self, prompt: list[int], decoding: Decoding, make_sampler: Callable[[], SequenceSampler]
    ) -> Generator[Item]:
        """The same, as a Python generator on the caller's thread; nothing is admitted before
        the first ``next()``, and a token is decoded once the one before it was taken."""
        return self.pull(lambda sink: self._sequence(prompt, decoding, make_sampler, sink))

    def _sequence(
        self,
        prompt: list[int],
        decoding: Decoding,
        make_sampler: Callable[[], SequenceSampler],
        sink: Sink,
    ) -> _Sequence:
        return _Sequence(
            list(prompt),
            decoding,
            max_new(prompt, decoding, self.n_ctx),
            sink,
            make_sampler=make_sampler,
        )

    # --- the decoding thread ---------------------------------------------------------------------

    def _room(self) -> bool:
        """Before an admission: the free slots' caches dropped when asked, the context grown
        for all the slots once a second sequence comes."""
        if self._dropping:
            self._dropping = False
            for slot in range(self.slots):
                if slot not in self._slots:
                    self._cached.pop(slot, None)
        return len(self._slots) < self._capacity or self._grow()

    def _admit(self, seq: _Sequence) -> None:
        free = [s for s in range(self._capacity) if s not in self._slots]
        choice = pick_slot(free, self._cached, self._last_used, seq.prompt)
        slot, keep = choice.slot, kept(seq.images, choice.keep)
        if seq.decoding.echo:
            keep = 0  # a scored prompt needs every position's logits: it runs whole
        elif choice.copy_from is not None:
            # Another slot's cells, whole (llama.cpp copies across sequences only so), at the
            # next decode; what is past the common prefix is dropped below.
            llama_cpp.llama_memory_seq_cp(self._memory, choice.copy_from, slot, -1, -1)
        at = position(seq.images, keep)
        if not llama_cpp.llama_memory_seq_rm(self._memory, slot, at, -1):
            # A cache that cannot drop a part (a recurrent model's) is dropped whole.
            llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
            keep = 0
        self._cached[slot] = seq.prompt[:keep]
        seq.slot, seq.prefilled = slot, keep
        self._slots[slot] = seq
        if self.speculative is not None:
            seq.ngrams = NgramIndex(self.speculative, seq.prompt)
        try:
            assert seq.make_sampler is not None
            seq.sampler = seq.make_sampler()
        except Exception as exc:  # its slot is freed at the next step
            seq.end(exc)
        if keep and not seq.finished:
            seq.emit(PromptCached(keep))

    def _forget(self, seq: _Sequence) -> None:
        """Its slot is free; its cache stays, for a later prompt that starts the same way."""
        del self._slots[seq.slot]
        self._last_used[seq.slot] = time.monotonic()
        if seq.sampler is not None:
            seq.sampler.close()

    def _drop(self, slot: int) -> None:
        """A slot's cache, which a failure left in no known state."""
        llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self._cached.pop(slot, None)

    def _step(self, ready: list[_Sequence]) -> None:
        try:
            self._decode(ready)
        except Exception as exc:  # a failed decode ends the sequences that were in it
            log.exception("a batch of %d sequences failed", len(ready))
            for seq in ready:
                self._drop(seq.slot)
                seq.end(exc)

    def _decode(self, ready: list[_Sequence]) -> None:
        for seq in ready:
            self._evaluate_images(seq)
        ready = [s for s in ready if not s.finished]
        if not ready:
            return
        needs = [Need(s.slot, s.text_left(), s.decoding.echo, self._want_draft(s)) for s in ready]
        plan = plan_step(needs, self._batch.capacity)
        batch = self._batch
        batch.clear()
        # Per sequence: where its part starts in the batch, how many tokens, where its logits are.
        parts: list[tuple[_Sequence, int, int]] = []
        by_slot = {s.slot: s for s in ready}
        for slot, n in plan.items():
            seq = by_slot[slot]
            first = batch.n
            cached = self._cached[seq.slot]
            if seq.prefill_left == 0:
                assert seq.next_token is not None
                at = position(seq.images, len(cached))
                batch.add(seq.next_token, at, seq.slot, logits=True)
                del seq.draft[n - 1 :]  # what the batch had room for
                for i, token in enumerate(seq.draft, start=1):
                    batch.add(token, at + i, seq.slot, logits=True)
            else:
                start = seq.prefilled
                shift = start - position(seq.images, start)  # the images' positions before
                for i in range(start, start + n):
                    last = i == len(seq.prompt) - 1
                    logits = seq.decoding.echo or last
                    batch.add(seq.prompt[i], i - shift, seq.slot, logits=logits)
            parts.append((seq, first, n))
        batch.decode(self._ctx)
        for seq, first, n in parts:
            cached = self._cached[seq.slot]
            if seq.prefill_left == 0:
                assert seq.next_token is not None
                cached.append(seq.next_token)
                seq.next_token = None
                if seq.draft:
                    self._verify(seq, first)
                else:
                    self._sample(seq, first)
                continue
            start = seq.prefilled
            cached.extend(seq.prompt[start : start + n])
            seq.prefilled += n
            if seq.decoding.echo:
                self._score(seq, first, start, n)
            if seq.prefill_left == 0:
                if seq.decoding.echo and not seq.emit(PromptScores(tuple(seq.scores))):
                    continue
                self._sample(seq, first + n - 1)

    def _evaluate_images(self, seq: _Sequence) -> None:
        """The images where the sequence's prompt is now, each whole, on its own sequence;
        an image that fails ends its sequence alone."""
        while seq.prefill_left > 0 and (image := image_at(seq.images, seq.prefilled)):
            if seq.decoding.stop_asked():
                seq.end()
                return
            try:
                if self._evaluate_image is None:
                    raise RuntimeError("this engine reads no images")
                at = position(seq.images, image.start)
                self._evaluate_image(self._ctx, image, seq.slot, at)
            except Exception as exc:
                log.exception("an image of the prompt in slot %d failed", seq.slot)
                self._drop(seq.slot)
                seq.end(exc)
                return
            self._cached[seq.slot].extend([image.token] * image.n_tokens)
            seq.prefilled += image.n_tokens

    def _score(self, seq: _Sequence, first: int, start: int, n: int) -> None:
        """A scored prompt's tokens in this step: each given the ones before it (the first has
        none), from the position before it."""
        prompt, k = seq.prompt, seq.decoding.top_logprobs or 0
        if start == 0:
            seq.scores.append(Token(prompt[0]))
        for j in range(n):
            if start + j + 1 < len(prompt):
                seq.scores.append(scored(self._logits(first + j), prompt[start + j + 1], k))

    def _sample(self, seq: _Sequence, index: int) -> int | None:
        """The sequence's next token, from the logits at batch ``index``; None when the
        sequence ended instead, or with it."""
        if seq.sampled >= seq.max_new:
            seq.end()
            return None
        assert seq.sampler is not None
        logits = self._logits(index)
        try:
            token = seq.sampler.sample(logits)
        except Exception as exc:  # this sequence's alone (a grammar it cannot follow)
            seq.end(exc)
            return None
        k = seq.decoding.top_logprobs
        seq.sampled += 1
        if seq.ngrams is not None:
            seq.ngrams.extend((token,))
        if not seq.emit(Token(token) if k is None else scored(logits, token, k)):
            return None
        pos = len(self._cached[seq.slot])
        if self._is_end(token) or seq.sampled >= seq.max_new or pos + 1 >= self.n_ctx:
            seq.end()  # what is generated fits in the context, as check_request counts
            return None
        seq.next_token = token
        return token

    def _want_draft(self, seq: _Sequence) -> int:
        """Drafts the sequence's next tokens (``seq.draft``) if it is decoding with
        speculation, as many as it may still generate and its context holds; their number."""
        seq.draft = []
        if seq.ngrams is None or seq.prefill_left > 0 or seq.next_token is None:
            return 0
        room = min(
            seq.max_new - seq.sampled - 1,  # the last token is sampled after the draft's
            self.n_ctx - len(self._cached[seq.slot]) - 2,  # the next token and the one after
        )
        seq.draft = seq.ngrams.draft(room) if room > 0 else []
        return len(seq.draft)

    def _verify(self, seq: _Sequence, first: int) -> None:
        """Samples the positions of the next token and its draft (from batch ``first`` on) in
        order while the sampler picks the draft's tokens; drops the cells of the rest."""
        cached, draft = self._cached[seq.slot], seq.draft

        def sample(i: int) -> int | None:
            if i > 0:  # the draft's token before this position was picked: it is cached
                cached.append(draft[i - 1])
                seq.next_token = None
            return self._sample(seq, first + i)

        picked = verified(draft, sample)
        misses = (i for i, (a, b) in enumerate(zip(picked, draft, strict=False)) if a != b)
        accepted = next(misses, min(len(picked), len(draft)))
        seq.drafted += len(draft)
        seq.accepted += accepted
        self.drafted += len(draft)
        self.accepted += accepted
        at = position(seq.images, len(cached))
        llama_cpp.llama_memory_seq_rm(self._memory, seq.slot, at, -1)
        seq.draft = []

    def _logits(self, index: int) -> Logits:
        """A view of the logits the last decode gave at batch ``index`` (valid until the next
        decode)."""
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, index)
        if not pointer:
            raise RuntimeError(f"no logits at batch index {index}")
        logits: Logits = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))
        return logits
