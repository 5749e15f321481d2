"""One MLX model split by layers across processes (pipeline parallel), over mlx's ring backend.

Rank ``r`` holds only layers ``start_layer..end_layer`` of the model; rank 0 also the token
embedding, the last rank the final norm and the output layer (and the embedding too when the
output layer is tied to it). The ranks form mlx's TCP ring (``mx.distributed``, backend
"ring"): each rank sends to the next one and receives from the previous one, and the last rank's
"next" is rank 0.

Rank 0 (``PipelineHead``) is an ``Engine``: the runner's TaskServer serves tasks with it as with
a single-process engine, up to ``slots`` at once. Every rank keeps the same sequences in the same
slots (``mlx_stage.StageCaches``), and each command from rank 0 changes them alike:

- START gives a sequence a slot, with its whole decoding (sampling parameters, seed, grammar,
  log-probabilities, echo); the last rank makes its ``Picker`` (``mlx_sampling``: the same
  grammar, penalties and random key as one process).
- RUN sends a chunk of one prompt's hidden states through every rank's layers, on that
  sequence's own caches. With echo the last rank scores each chunk; the last chunk's last
  position gives the first token, and the sequence joins the decoding batch on every rank.
- STEP sends one token for every sequence in the decoding batch at once (rows in the order they
  joined): one forward pass of ``rows`` tokens a rank, and the last rank picks each row's token
  with its own picker and answers a reply a row.
- STOP frees a slot (the consumer stopped: a stop string, the limit, a cancel; or the sequence
  ended), on every rank.

Rank 0 waits for the replies of each command before it sends the next, so nothing is ever in
flight between two steps, and it alternates a prompt's chunk with a decoding step while both
have work: a long prompt holds the others back by one chunk at a time. Ranks > 0
(``PipelineFollower``) run ``follow()`` until rank 0 sends SHUTDOWN; if the connection to a
neighbour is lost, mlx raises and ``follow()`` raises ``PipelineBroken``.

The ring, its sockets and its messages are ``mlx_ring``; a rank's layers and caches are
``mlx_stage``; admission and the consumers' queues are ``batch_thread``'s.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.runner.decoding import Decoding, PromptScores, Token
from services.runner.engines.batch_thread import DecodingThread, Generation, max_new
from services.runner.engines.mlx import (
    MlxText,
    MlxTextEngine,
    context_length,
    prefill_chunks,
)
from services.runner.engines.mlx_ring import (
    DTYPES,
    Answer,
    Command,
    Header,
    PipelineBroken,
    PipelineShard,
    Reply,
    Ring,
    Run,
    StartRequest,
    bytes_array,
    connect,
)
from services.runner.engines.mlx_sampling import (
    Grammars,
    Picker,
    check_decoding,
    prompt_scores,
    resolve_seed,
)
from services.runner.engines.mlx_stage import Stage, StageCaches
from services.runner.generation import InvalidRequest

log = logging.getLogger(__name__)


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
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._dir = model_dir
        self._shard = shard
        self._requested_ctx = n_ctx
        self._n_ctx = n_ctx
        self.slots = slots
        self._connect_timeout = connect_timeout
        self._stage: Stage | None = None
        self._text: MlxText | None = None
        self._ring: Ring | None = None
        self._decoder: _RingDecoder | None = None

    def load(self) -> None:
        self.load_weights()
        self.join()

    def load_weights(self) -> None:
        """This rank's layers and the tokenizer."""
        stage = Stage.load(self._dir, self._shard)
        self._text = MlxText.load(self._dir, stage.config)
        self._n_ctx = context_length(self._requested_ctx, stage.config)
        self._stage = stage

    def join(self) -> None:
        """Join the ring (see ``connect`` for the timing between ranks)."""
        if self._stage is None or self._text is None:
            raise RuntimeError("load_weights() comes first")
        self._ring = connect(self._shard, self._connect_timeout)
        self._decoder = _RingDecoder(self._stage, self._ring, slots=self.slots,
                                     n_ctx=self._n_ctx, ends=self._text.ends)  # fmt: skip

    @property
    def passes(self) -> tuple[int, int]:
        """Decoding steps made so far, and the most rows one had."""
        decoder = self._parts()
        return decoder.steps, decoder.widest

    def _parts(self) -> _RingDecoder:
        if self._decoder is None:
            raise RuntimeError("engine not loaded")
        return self._decoder

    def generate(self, prompt: list[int], decoding: Decoding) -> Iterator[Token | PromptScores]:
        decoder = self._parts()
        if decoder.broken is not None:
            raise decoder.broken
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens, the context {self.n_ctx}")
        # Refused here, before anything is sent; the last rank compiles the grammar.
        check_decoding(decoding, self.n_vocab)
        start = StartRequest.of(decoding, resolve_seed(decoding.params), prompt)
        return decoder.generate(prompt, decoding, start.model_dump_json().encode())

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
        self._ring.send_message(Header(Command.SHUTDOWN))
        ack = self._ring.recv_reply()
        if ack.kind != Answer.SHUTDOWN_ACK:
            last = self._shard.world_size - 1
            raise PipelineBroken(f"rank {last} answered {ack.kind} to shutdown")


@dataclass(eq=False)
class _Flow(Generation):
    """A generation as the head runs it: its START, its slot, the chunks of its prompt still
    to run, the scores of its prompt (echo) and its last token."""

    start: bytes = b""
    slot: int = -1
    chunks: list[list[int]] = field(default_factory=list)
    scored: list[Token] = field(default_factory=list)
    last: int = -1  # in the decoding batch: the token its next step feeds


class _RingDecoder(DecodingThread[_Flow]):
    """The head's decoding thread: the only one that talks on the ring. Each step is either a
    chunk of one prompt (the oldest being prefilled) or a token for every sequence of the
    decoding batch, in turn while both have work, so a long prompt holds the others back by
    one chunk at a time."""

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

    def generate(
        self, prompt: list[int], decoding: Decoding, start: bytes
    ) -> Generator[Token | PromptScores]:
        flow = _Flow(list(prompt), decoding, max_new(prompt, decoding, self._n_ctx), start=start)
        return self._stream(flow)

    def _is_fatal(self, exc: Exception) -> bool:
        if isinstance(exc, PipelineBroken):
            self.broken = exc
            return True
        return False

    def _discard(self) -> None:
        self._caches = StageCaches(self._stage, 0)  # the sequences' caches are freed

    def _admit(self, flow: _Flow) -> None:
        slot = min(set(range(self.slots)) - self._by_slot.keys())
        self._ring.send_message(Header(Command.START, slot, extra=len(flow.start)),
                                bytes_array(flow.start))  # fmt: skip
        self._caches.start(slot)
        flow.slot = slot
        flow.chunks = prefill_chunks(flow.prompt)
        flow.scored = [Token(flow.prompt[0])]
        self._by_slot[slot] = flow
        self._scored(flow)

    def _scored(self, flow: _Flow) -> None:
        """Once a scored prompt (echo) has all its scores, they go out first."""
        if flow.decoding.echo and len(flow.chunks) == 1:
            flow.put(PromptScores(tuple(flow.scored)))
            if flow.max_new <= 0:
                flow.end()

    def _forget(self, flow: _Flow) -> None:
        """Every rank drops the sequence (nothing of it is ever in flight between steps)."""
        self._ring.send_message(Header(Command.STOP, flow.slot))
        self._caches.drop(flow.slot)
        del self._by_slot[flow.slot]

    def _step(self) -> None:
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
        flags = Run.SAMPLE if not flow.chunks else Run.SCORE if echo else Run(0)
        h = self._caches.prefill(flow.slot, mx.array([chunk]))
        self._caches.evaluate(h)
        header = Header(Command.RUN, flow.slot, len(chunk), int(flags), DTYPES.index(h.dtype))
        self._ring.send_message(header, h)
        if flags & Run.SAMPLE:
            self._caches.join(flow.slot)
        if not flags:
            return
        # Waited for before anything else leaves: the ring never holds a chunk and a reply
        # at once (a rank could block sending while its receiver does).
        reply = self._ring.recv_reply()
        try:
            tokens = reply.tokens()
        except InvalidRequest as exc:  # this sequence's alone
            flow.end(exc)
            return
        if flags & Run.SCORE:
            flow.scored += tokens
            self._scored(flow)
        else:
            self._deliver(flow, tokens[0])

    def _decode(self) -> None:
        rows = list(self._caches.rows)
        x = mx.array([[self._by_slot[slot].last] for slot in rows])
        h = self._caches.step(rows, x)
        self._caches.evaluate(h)
        header = Header(Command.STEP, tokens=len(rows), dtype=DTYPES.index(h.dtype))
        self._ring.send_message(header, mx.array(rows, dtype=mx.int32), h)
        self.steps += 1
        self.widest = max(self.widest, len(rows))
        for slot in rows:
            reply = self._ring.recv_reply()
            flow = self._by_slot[slot]
            if flow.finished:
                continue
            try:
                self._deliver(flow, reply.tokens()[0])
            except InvalidRequest as exc:  # this sequence's alone
                flow.end(exc)

    def _deliver(self, flow: _Flow, token: Token) -> None:
        flow.put(token)
        flow.last = token.id
        if token.id in self._ends or flow.given >= flow.max_new:
            flow.end()


class PipelineFollower:
    """A rank > 0 of a pipeline: ``load()`` (or ``load_weights()`` and ``join()``), then
    ``follow()`` until rank 0 shuts it down."""

    def __init__(
        self, model_dir: Path, shard: PipelineShard, *, connect_timeout: float = 120.0
    ) -> None:
        if shard.first:
            raise ValueError("rank 0 is the head, not a follower")
        self._dir = model_dir
        self._shard = shard
        self._connect_timeout = connect_timeout
        self._stage: Stage | None = None
        self._ring: Ring | None = None
        self._text: MlxText | None = None
        self.requests = 0

    def load(self) -> None:
        self.load_weights()
        self.join()

    def load_weights(self) -> None:
        self._stage = Stage.load(self._dir, self._shard)
        if self._shard.last:  # it picks the tokens: the grammars need the vocabulary
            self._text = MlxText.load(self._dir, self._stage.config)
            _ = self._text.grammars  # built now, not in the first task with a grammar

    def join(self) -> None:
        """Join the ring (see ``connect`` for the timing between ranks)."""
        self._ring = connect(self._shard, self._connect_timeout)

    def _grammars(self) -> Grammars:
        """The last rank's grammars (for their vocabulary and the triggers' text)."""
        if self._text is None:
            raise RuntimeError("only the last rank picks tokens")
        return self._text.grammars

    def follow(self) -> None:
        """Serve rank 0's commands; returns on shutdown, raises ``PipelineBroken`` when a
        neighbour is lost."""
        if self._stage is None or self._ring is None:
            raise RuntimeError("follower not loaded")
        stage, ring, last = self._stage, self._ring, self._shard.last
        caches = StageCaches(stage, ring.rank)
        requests: dict[int, _Request] = {}  # the last rank's, by slot
        while True:
            header = ring.recv_header()
            command, slot = header.command, header.slot
            if command == Command.SHUTDOWN:
                if last:
                    ring.send_reply(Reply(Answer.SHUTDOWN_ACK))
                else:
                    ring.send_message(header)
                return
            if command == Command.STOP:
                caches.drop(slot)
                requests.pop(slot, None)
                if not last:
                    ring.send_message(header)
            elif command == Command.START:
                payload = ring.recv((header.extra,), mx.uint8)
                if not last:
                    ring.send_message(header, payload)
                caches.start(slot)
                if last:
                    requests[slot] = _Request.begin(np.array(payload).tobytes(), stage,
                                                    self._grammars)  # fmt: skip
                self.requests += 1
            elif command == Command.RUN:
                shape = (1, header.tokens, stage.hidden_size)
                h = caches.prefill(slot, ring.recv(shape, DTYPES[header.dtype]))
                flags = Run(header.extra)
                if last:
                    reply = requests[slot].run(stage, h, flags)
                    caches.evaluate(h)
                    if reply is not None:
                        ring.send_reply(reply)
                else:
                    caches.evaluate(h)
                    ring.send_message(header, h)
                if flags & Run.SAMPLE:
                    caches.join(slot)
            elif command == Command.STEP:
                rows = ring.recv((header.tokens,), mx.int32)
                slots = [int(r) for r in np.array(rows)]
                shape = (header.tokens, 1, stage.hidden_size)
                h = caches.step(slots, ring.recv(shape, DTYPES[header.dtype]))
                if last:
                    logits = stage.logits(h)
                    replies = [requests[s].pick(logits[i : i + 1]) for i, s in enumerate(slots)]
                    caches.evaluate(h)
                    for reply in replies:
                        ring.send_reply(reply)
                else:
                    caches.evaluate(h)
                    ring.send_message(header, rows, h)
            else:
                raise PipelineBroken(f"rank {ring.rank}: unknown command {command}")


@dataclass
class _Request:
    """A sequence as the last rank holds it: its picker (or why it has none), the prompt it
    scores (echo) and how far the prompt has come."""

    picker: Picker | None = None
    error: str = ""
    top_logprobs: int = 0
    prompt: list[int] = field(default_factory=list)
    position: int = 0

    @classmethod
    def begin(cls, payload: bytes, stage: Stage, grammars: Callable[[], Grammars]) -> _Request:
        start = StartRequest.model_validate_json(payload)
        request = cls(top_logprobs=start.top_logprobs or 0, prompt=start.prompt)
        try:
            request.picker = Picker(start.decoding(), start.seed, stage.vocab_size, grammars)
        except InvalidRequest as exc:  # answered to the first RUN that wants an answer
            request.error = str(exc)
        return request

    def run(self, stage: Stage, h: mx.array, flags: Run) -> Reply | None:
        """A chunk of the prompt; the reply rank 0 waits for, if it waits for one."""
        begin, self.position = self.position, self.position + h.shape[1]
        if not flags & (Run.SAMPLE | Run.SCORE):
            return None
        if flags & Run.SAMPLE:
            return self.pick(stage.logits(h))
        if self.picker is None:
            return self._failed()
        targets = self.prompt[begin + 1 : begin + h.shape[1] + 1]
        ids, lps = prompt_scores(stage.every_logits(h), targets, self.top_logprobs)
        return Reply(Answer.SCORES, 0, ids, lps)

    def pick(self, logits: mx.array) -> Reply:
        """The next token from ``logits`` (1, vocab)."""
        if self.picker is None:
            return self._failed()
        try:
            token = self.picker.pick(logits)
        except InvalidRequest as exc:  # the grammar could not go on: the task fails
            self.picker, self.error = None, str(exc) or type(exc).__name__
            return self._failed()
        if token.logprob is None:
            return Reply(Answer.TOKEN, token.id)
        ids = np.array([[token.id, *(i for i, _ in token.top)]], dtype=np.int32)
        lps = np.array([[token.logprob, *(lp for _, lp in token.top)]], dtype=np.float32)
        return Reply(Answer.TOKEN, token.id, ids, lps)

    def _failed(self) -> Reply:
        return Reply(Answer.ERROR, message=self.error or "the request could not start")


def main(argv: list[str] | None = None) -> int:
    """A rank > 0 as its own process: load, join the ring, follow until shut down. Exit status
    0 after a shutdown, 1 when the ring broke."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", type=Path, required=True, help="the MLX model directory")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--layers", required=True, help="START:END, END exclusive")
    parser.add_argument("--n-layers", type=int, required=True)
    parser.add_argument("--hosts", required=True, help="ip:port of every rank, comma-separated")
    parser.add_argument("--connect-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    start, _, end = args.layers.partition(":")
    hosts = tuple(h.strip() for h in args.hosts.split(","))
    shard = PipelineShard(args.rank, len(hosts), int(start), int(end), args.n_layers, hosts)
    follower = PipelineFollower(args.model, shard, connect_timeout=args.connect_timeout)
    follower.load()
    log.info("rank %d of %d: layers %d-%d, in the ring", shard.rank, shard.world_size,
             shard.start_layer, shard.end_layer - 1)  # fmt: skip
    try:
        follower.follow()
    except PipelineBroken as exc:
        log.error("%s", exc)
        return 1
    log.info("rank %d: shut down after %d requests", shard.rank, follower.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
