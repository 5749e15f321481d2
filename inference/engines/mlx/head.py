"""Rank 0 of an MLX pipeline (``PipelineHead``): an ``Engine`` whose decoding thread drives the
ring. How the ranks work together is told in ``mlx_pipeline``; the commands it sends are
``mlx_wire``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from inference.decoding import Decoding, PromptCached, PromptScores, Sink, Token, request_seed
from inference.engines.batch_loop import BatchLoop, Generation, max_new
from inference.engines.mlx import wire
from inference.engines.mlx.engine import MlxTextEngine
from inference.engines.mlx.ring import PipelineBroken, PipelineShard, Ring, connect
from inference.engines.mlx.sampling import check_decoding
from inference.engines.mlx.single import prefill_chunks
from inference.engines.mlx.stage import Stage, StageCaches
from structured.reply import InvalidRequest


class PipelineHead(MlxTextEngine):
    """Rank 0 of a pipeline, as an ``Engine`` decoding up to ``slots`` generations at once.
    ``load()`` loads this rank's layers and the tokenizer, then joins the ring
    (``load_weights()`` and ``join()``, for a caller that waits for the other ranks in
    between); ``shutdown()`` ends every rank's ``follow()``. After ``PipelineBroken`` it
    serves no more: every generation fails with it."""

    def __init__(
        self,
        model_dir: Path,
        shard: PipelineShard,
        *,
        n_ctx: int = 2048,
        slots: int = 1,
        connect_timeout: float = 120.0,
    ) -> None:
        if not shard.first:
            raise ValueError(f"rank {shard.rank} follows; only rank 0 is the head")
        super().__init__(model_dir, n_ctx=n_ctx, slots=slots)
        self._shard = shard
        self._connect_timeout = connect_timeout
        self._stage: Stage | None = None
        self._ring: Ring | None = None
        self._decoder: _RingDecoder | None = None

    def load(self) -> None:
        self.load_weights()
        self.join()

    def load_weights(self) -> None:
        """This rank's layers and the tokenizer."""
        stage = Stage.load(self._dir, self._shard)
        self._load_text(stage.config)
        self._stage = stage

    def join(self) -> None:
        """Join the ring (see ``connect`` for the timing between ranks)."""
        if self._stage is None or self._text is None:
            raise RuntimeError("load_weights() comes first")
        self._ring = connect(self._shard, self._connect_timeout)
        self._decoder = _RingDecoder(
            self._stage, self._ring, slots=self.slots, n_ctx=self._n_ctx, ends=self._text.ends
        )

    @property
    def passes(self) -> tuple[int, int]:
        """Decoding steps made so far, and the most rows one had."""
        decoder = self._parts()
        return decoder.steps, decoder.widest

    def _parts(self) -> _RingDecoder:
        if self._decoder is None:
            raise RuntimeError("engine not loaded")
        return self._decoder

    def generate(
        self, prompt: list[int], decoding: Decoding
    ) -> Iterator[Token | PromptScores | PromptCached]:
        decoder, start = self._start(prompt, decoding)
        return decoder.pull(lambda sink: decoder.flow(prompt, decoding, start, sink))

    def submit(self, prompt: list[int], decoding: Decoding, sink: Sink) -> None:
        decoder, start = self._start(prompt, decoding)
        decoder.push(decoder.flow(prompt, decoding, start, sink))

    def _start(self, prompt: list[int], decoding: Decoding) -> tuple[_RingDecoder, bytes]:
        """The decoder, and the generation's START for the ring; what can be refused is
        refused here, before anything is sent (the last rank compiles the grammar)."""
        decoder = self._parts()
        if decoder.broken is not None:
            raise decoder.broken
        self.check_prompt(prompt)
        check_decoding(decoding, self.n_vocab)
        start = wire.StartRequest.of(decoding, request_seed(decoding.params), prompt)
        return decoder, start.model_dump_json().encode()

    def shutdown(self) -> None:
        """End every other rank's ``follow()``; returns once all have seen it. What is in
        flight fails."""
        if self._decoder is None or self._ring is None:
            return
        self._decoder.close()
        if self._decoder.broken is not None:
            return
        self._decoder.broken = PipelineBroken("the pipeline was shut down")
        # The decoding thread is parked: the ring is this thread's now.
        wire.send(self._ring, wire.Shutdown())
        ack = wire.receive_reply(self._ring)
        if not isinstance(ack, wire.ShutdownAck):
            last = self._shard.world_size - 1
            raise PipelineBroken(f"rank {last} answered {type(ack).__name__} to shutdown")


@dataclass(eq=False)
class _Flow(Generation):
    """A generation as the head runs it: its START, its slot, the chunks of its prompt still
    to run, the scores of its prompt (echo) and its last token."""

    start: bytes = b""
    slot: int = -1
    chunks: list[list[int]] = field(default_factory=list)
    scored: list[Token] = field(default_factory=list)
    last: int = -1  # in the decoding batch: the token its next step feeds


class _RingDecoder(BatchLoop[_Flow]):
    """The head's decoding thread: the only one that talks on the ring. Each step is either a
    chunk of one prompt (the oldest being prefilled) or a token for every sequence of the
    decoding batch, in turn while both have work, so a long prompt holds the others back by
    one chunk at a time."""

    # A pulled generation's next token is computed while its consumer takes the last one.
    lookahead = 2
    parks = True  # an MLX thread (see ``BatchLoop.close``)

    def __init__(
        self, stage: Stage, ring: Ring, *, slots: int, n_ctx: int, ends: Sequence[int]
    ) -> None:
        self._stage = stage
        self._ring = ring
        self._caches = StageCaches(stage, 0)
        self._n_ctx = n_ctx
        self._ends = frozenset(ends)
        self._by_slot: dict[int, _Flow] = {}
        self._prefill_turn = True
        self.broken: PipelineBroken | None = None
        self.steps = 0
        self.widest = 0
        super().__init__(slots, "mlx-ring")

    def flow(self, prompt: list[int], decoding: Decoding, start: bytes, sink: Sink) -> _Flow:
        n = max_new(prompt, decoding, self._n_ctx)
        return _Flow(list(prompt), decoding, n, sink, start=start)

    def _is_fatal(self, exc: Exception) -> bool:
        if isinstance(exc, PipelineBroken):
            self.broken = exc
            return True
        return False

    def _discard(self) -> None:
        self._caches = StageCaches(self._stage, 0)  # the sequences' caches are freed

    def _admit(self, flow: _Flow) -> None:
        slot = min(set(range(self.slots)) - self._by_slot.keys())
        wire.send(self._ring, wire.Start(slot, flow.start))
        self._caches.start(slot)
        flow.slot = slot
        flow.chunks = prefill_chunks(flow.prompt)
        flow.scored = [Token(flow.prompt[0])]
        self._by_slot[slot] = flow
        self._scored(flow)

    def _scored(self, flow: _Flow) -> None:
        """Once a scored prompt (echo) has all its scores, they go out first."""
        if not (flow.decoding.echo and len(flow.chunks) == 1):
            return
        if flow.emit(PromptScores(tuple(flow.scored))) and flow.max_new <= 0:
            flow.end()

    def _forget(self, flow: _Flow) -> None:
        """Every rank drops the sequence (nothing of it is ever in flight between steps)."""
        wire.send(self._ring, wire.Stop(flow.slot))
        self._caches.drop(flow.slot)
        del self._by_slot[flow.slot]

    def _step(self, ready: list[_Flow]) -> None:
        prefilling = [f for f in self._active if f.chunks and not f.finished]
        decoding = bool(self._caches.rows)
        if prefilling and (self._prefill_turn or not decoding):
            self._prefill(prefilling[0])
        elif decoding:
            self._decode()
        self._prefill_turn = not self._prefill_turn

    def _prefill(self, flow: _Flow) -> None:
        chunk = flow.chunks.pop(0)
        echo = flow.decoding.echo
        flags = wire.Run.SAMPLE if not flow.chunks else wire.Run.SCORE if echo else wire.Run(0)
        h = self._caches.prefill(flow.slot, mx.array([chunk]))
        self._caches.evaluate(h)
        wire.send(self._ring, wire.RunChunk(flow.slot, h, flags))
        if flags & wire.Run.SAMPLE:
            self._caches.join(flow.slot)
        if not flags:
            return
        # Waited for before anything else leaves: the ring never holds a chunk and a reply
        # at once (a rank could block sending while its receiver does).
        reply = wire.receive_reply(self._ring)
        try:
            tokens = wire.tokens(reply)
        except InvalidRequest as exc:  # this sequence's alone
            flow.end(exc)
            return
        if flags & wire.Run.SCORE:
            flow.scored += tokens
            self._scored(flow)
        else:
            self._deliver(flow, tokens[0])

    def _decode(self) -> None:
        rows = list(self._caches.rows)
        x = mx.array([[self._by_slot[slot].last] for slot in rows])
        h = self._caches.step(rows, x)
        self._caches.evaluate(h)
        # The last rank picks: a token forced on a sequence (a thinking budget's closing tag)
        # goes with the step. (A prompt's first token, picked at its last chunk, is never
        # forced: a resumed task whose budget was spent has its tag from its second token.)
        forced = [self._by_slot[slot].decoding.forced.next() for slot in rows]
        wire.send(
            self._ring, wire.Step(rows, h, [wire.NOT_FORCED if t is None else t for t in forced])
        )
        self.steps += 1
        self.widest = max(self.widest, len(rows))
        for slot in rows:
            reply = wire.receive_reply(self._ring)
            flow = self._by_slot[slot]
            if flow.finished:
                continue
            try:
                self._deliver(flow, wire.tokens(reply)[0])
            except InvalidRequest as exc:  # this sequence's alone
                flow.end(exc)

    def _deliver(self, flow: _Flow, token: Token) -> None:
        if not flow.emit(token):
            return  # it leaves the ring at the next step
        flow.last = token.id
        if token.id in self._ends or flow.given >= flow.max_new:
            flow.end()
