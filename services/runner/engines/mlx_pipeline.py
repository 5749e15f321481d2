"""One MLX model split by layers across processes (pipeline parallel), over mlx's ring backend.

Rank ``r`` holds only layers ``start_layer..end_layer`` of the model; rank 0 also the token
embedding, the last rank the final norm and the output layer (and the embedding too when the
output layer is tied to it). The ranks form mlx's TCP ring (``mx.distributed``, backend
"ring"): each rank sends to the next one and receives from the previous one, and the last rank's
"next" is rank 0.

Rank 0 (``PipelineHead``) is an ``Engine``: the runner's TaskServer serves tasks with it as with
a single-process engine. For each request it sends START down the ring with the whole decoding
(sampling parameters, seed, grammar, log-probabilities, echo), then the prompt's hidden states,
chunk by chunk; every rank runs its layers (with its own KV cache) and passes the result on; the
last rank computes the logits and picks the token with the same ``Picker`` as a single process
(``mlx_sampling``: grammar, penalties, its own random key), and sends it to rank 0 with its
log-probabilities; rank 0 yields it and, when asked for the next one, feeds it back in. With
echo, each prefill chunk is also scored there, and the scores come back to rank 0 before the
next chunk leaves. When the consumer stops iterating (a stop string, the limit, a cancel),
rank 0 sends STOP, so that every rank drops the request and waits for the next command: nothing
is ever in flight between two tokens. Ranks > 0 (``PipelineFollower``) run ``follow()`` until
rank 0 sends SHUTDOWN; if the connection to a neighbour is lost, mlx raises and ``follow()``
raises ``PipelineBroken``.

The ring, its sockets and its messages are ``mlx_ring``; a rank's layers are ``mlx_stage``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from services.runner.decoding import Decoding, PromptScores, Token
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
from services.runner.engines.mlx_stage import Stage
from services.runner.generation import InvalidRequest

log = logging.getLogger(__name__)


class PipelineHead(MlxTextEngine):
    """Rank 0 of a pipeline, as an ``Engine``. ``load()`` loads this rank's layers and the
    tokenizer, then joins the ring (``load_weights()`` and ``join()``, for a caller that waits
    for the other ranks in between); ``shutdown()`` ends every rank's ``follow()``. After
    ``PipelineBroken`` it serves no more: every call raises it again."""

    def __init__(
        self,
        model_dir: Path,
        shard: PipelineShard,
        *,
        n_ctx: int = 2048,
        connect_timeout: float = 120.0,
    ) -> None:
        if not shard.first:
            raise ValueError(f"rank {shard.rank} follows; only rank 0 is the head")
        self._dir = model_dir
        self._shard = shard
        self._requested_ctx = n_ctx
        self._n_ctx = n_ctx
        self._connect_timeout = connect_timeout
        self._stage: Stage | None = None
        self._text: MlxText | None = None
        self._ring: Ring | None = None
        self._broken: str | None = None
        self._active: weakref.ref[Generator[Token | PromptScores, None, None]] | None = None

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
        self._ring = connect(self._shard, self._connect_timeout)

    def _parts(self) -> tuple[Stage, Ring]:
        if self._broken is not None:
            raise PipelineBroken(self._broken)
        if self._stage is None or self._ring is None:
            raise RuntimeError("engine not loaded")
        return self._stage, self._ring

    def generate(self, prompt: list[int], decoding: Decoding) -> Iterator[Token | PromptScores]:
        self._parts()
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if len(prompt) >= self.n_ctx:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens, the context {self.n_ctx}")
        # Refused here, before anything is sent; the last rank compiles the grammar.
        check_decoding(decoding, self.n_vocab)
        self._end_active()
        start = StartRequest.of(decoding, resolve_seed(decoding.params), prompt)
        tokens = self._generate(prompt, decoding, start.model_dump_json().encode())
        self._active = weakref.ref(tokens)
        return tokens

    def _end_active(self) -> None:
        """One request at a time on the ring: a generation left suspended is ended first."""
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()

    def _generate(
        self, prompt: list[int], decoding: Decoding, start: bytes
    ) -> Generator[Token | PromptScores, None, None]:
        stage, ring = self._parts()
        owed = False  # a reply is owed by the last rank
        try:
            ring.send_message(Header(Command.START, extra=len(start)), bytes_array(start))
            cache = stage.new_cache()
            *body, last = prefill_chunks(prompt)
            scored = [Token(prompt[0])]
            for chunk in body:
                self._run(stage, ring, cache, chunk, Run.SCORE if decoding.echo else Run(0))
                if decoding.echo:
                    # Waited for before the next chunk leaves: the ring never holds a chunk
                    # and scores at once (a rank could block sending while its receiver does).
                    owed = True
                    reply = ring.recv_reply()
                    owed = False
                    scored += reply.tokens()
            if decoding.echo:
                yield PromptScores(tuple(scored))
            step = last
            position = len(prompt)
            while True:
                self._run(stage, ring, cache, step, Run.SAMPLE)
                owed = True
                reply = ring.recv_reply()
                owed = False
                token = reply.tokens()[0]
                yield token
                position += 1
                if position >= self.n_ctx:
                    return
                step = [token.id]
        except PipelineBroken as exc:
            self._broken = str(exc)
            raise
        finally:
            # Every way out but a lost ring (the consumer stopped, the context is full, an
            # error here or on the last rank) leaves the other ranks ready for the next one.
            if self._broken is None:
                try:
                    if owed:
                        ring.recv_reply()
                    ring.send_message(Header(Command.STOP))
                except PipelineBroken as exc:
                    self._broken = str(exc)
                    raise

    def _run(
        self, stage: Stage, ring: Ring, cache: list[Any], tokens: list[int], flags: Run
    ) -> None:
        h = stage.hidden(mx.array([tokens]), cache)
        mx.eval(h, [c.state for c in cache])
        header = Header(Command.RUN, len(tokens), int(flags), DTYPES.index(h.dtype))
        ring.send_message(header, h)

    def shutdown(self) -> None:
        """End every other rank's ``follow()``; returns once all have seen it."""
        if self._ring is None or self._broken is not None:
            return
        self._end_active()
        self._ring.send_message(Header(Command.SHUTDOWN))
        ack = self._ring.recv_reply()
        self._broken = "the pipeline was shut down"
        if ack.kind != Answer.SHUTDOWN_ACK:
            last = self._shard.world_size - 1
            raise PipelineBroken(f"rank {last} answered {ack.kind} to shutdown")


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
        """Serve rank 0's requests; returns on shutdown, raises ``PipelineBroken`` when a
        neighbour is lost."""
        if self._stage is None or self._ring is None:
            raise RuntimeError("follower not loaded")
        stage, ring = self._stage, self._ring
        request: _Request | None = None
        while True:
            header = ring.recv_header()
            command = header.command
            if command == Command.SHUTDOWN:
                if self._shard.last:
                    ring.send_reply(Reply(Answer.SHUTDOWN_ACK))
                else:
                    ring.send_message(header)
                return
            if command == Command.STOP:
                request = None
                if not self._shard.last:
                    ring.send_message(header)
            elif command == Command.START:
                payload = ring.recv((header.extra,), mx.uint8)
                if not self._shard.last:
                    ring.send_message(header, payload)
                request = _Request(stage.new_cache())
                if self._shard.last:
                    request.begin(np.array(payload).tobytes(), stage, self._grammars)
                self.requests += 1
            elif command == Command.RUN:
                if request is None:
                    raise PipelineBroken(f"rank {ring.rank}: hidden states outside a request")
                shape = (1, header.tokens, stage.hidden_size)
                h = stage.hidden(ring.recv(shape, DTYPES[header.dtype]), request.cache)
                if not self._shard.last:
                    mx.eval(h, [c.state for c in request.cache])
                    ring.send_message(header, h)
                else:
                    reply = request.run(stage, h, Run(header.extra))
                    if reply is not None:
                        ring.send_reply(reply)
            else:
                raise PipelineBroken(f"rank {ring.rank}: unknown command {command}")


@dataclass
class _Request:
    """A request as a follower holds it: its KV cache; on the last rank, its picker, the
    prompt it scores (echo) and how far the prompt has come."""

    cache: list[Any]
    picker: Picker | None = None
    error: str = ""
    top_logprobs: int = 0
    prompt: list[int] = field(default_factory=list)
    position: int = 0

    def begin(self, payload: bytes, stage: Stage, grammars: Callable[[], Grammars]) -> None:
        start = StartRequest.model_validate_json(payload)
        self.top_logprobs = start.top_logprobs or 0
        self.prompt = start.prompt
        try:
            self.picker = Picker(start.decoding(), start.seed, stage.vocab_size, grammars)
        except InvalidRequest as exc:  # answered to the first RUN that wants an answer
            self.error = str(exc)

    def run(self, stage: Stage, h: mx.array, flags: Run) -> Reply | None:
        """The last rank's part of a RUN; the reply rank 0 waits for, if it waits for one."""
        begin, self.position = self.position, self.position + h.shape[1]
        if not flags & (Run.SAMPLE | Run.SCORE):
            mx.eval(h, [c.state for c in self.cache])
            return None
        if self.picker is None:
            mx.eval(h, [c.state for c in self.cache])
            return Reply(Answer.ERROR, message=self.error or "the request could not start")
        try:
            if flags & Run.SCORE:
                targets = self.prompt[begin + 1 : begin + h.shape[1] + 1]
                ids, lps = prompt_scores(stage.every_logits(h), targets, self.top_logprobs)
                mx.eval([c.state for c in self.cache])
                return Reply(Answer.SCORES, 0, ids, lps)
            token = self.picker.pick(stage.logits(h))
        except InvalidRequest as exc:  # the grammar could not go on: the task fails
            self.picker, self.error = None, str(exc) or type(exc).__name__
            return Reply(Answer.ERROR, message=self.error)
        if token.logprob is None:
            return Reply(Answer.TOKEN, token.id)
        ids = np.array([[token.id, *(i for i, _ in token.top)]], dtype=np.int32)
        lps = np.array([[token.logprob, *(lp for _, lp in token.top)]], dtype=np.float32)
        return Reply(Answer.TOKEN, token.id, ids, lps)


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
