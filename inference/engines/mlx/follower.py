"""The ranks > 0 of an MLX pipeline (``PipelineFollower``): each runs its layers on what the
previous rank sends and passes it on; the last one picks the tokens and answers rank 0. How
the ranks work together is told in ``mlx_pipeline``; the commands are ``mlx_wire``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from inference.engines.mlx import wire
from inference.engines.mlx.engine import MlxText
from inference.engines.mlx.ring import PipelineShard, Ring, connect
from inference.engines.mlx.sampling import Grammars, Picker, prompt_scores
from inference.engines.mlx.stage import Stage, StageCaches
from structured.reply import InvalidRequest


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
            message = wire.receive(ring, stage.hidden_size)
            match message:
                case wire.Shutdown():
                    if last:
                        wire.send_reply(ring, wire.ShutdownAck())
                    else:
                        wire.send(ring, message)
                    return
                case wire.Stop(slot):
                    caches.drop(slot)
                    requests.pop(slot, None)
                    if not last:
                        wire.send(ring, message)
                case wire.Start(slot, request):
                    if not last:
                        wire.send(ring, message)
                    caches.start(slot)
                    if last:
                        requests[slot] = _Request.begin(request, stage, self._grammars)
                    self.requests += 1
                case wire.RunChunk(slot, hidden, flags):
                    h = caches.prefill(slot, hidden)
                    if last:
                        reply = requests[slot].run(stage, h, flags)
                        caches.evaluate(h)
                        if reply is not None:
                            wire.send_reply(ring, reply)
                    else:
                        caches.evaluate(h)
                        wire.send(ring, wire.RunChunk(slot, h, flags))
                    if flags & wire.Run.SAMPLE:
                        caches.join(slot)
                case wire.Step(slots, hidden, forced):
                    h = caches.step(slots, hidden)
                    if last:
                        logits = stage.logits(h)
                        replies = [
                            requests[s].pick(logits[i : i + 1], message.forced_at(i))
                            for i, s in enumerate(slots)
                        ]
                        caches.evaluate(h)
                        for reply in replies:
                            wire.send_reply(ring, reply)
                    else:
                        caches.evaluate(h)
                        wire.send(ring, wire.Step(slots, h, forced))


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
        start = wire.StartRequest.model_validate_json(payload)
        request = cls(top_logprobs=start.top_logprobs or 0, prompt=start.prompt)
        try:
            request.picker = Picker(start.decoding(), start.seed, stage.vocab_size, grammars)
        except InvalidRequest as exc:  # answered to the first RUN that wants an answer
            request.error = str(exc)
        return request

    def run(self, stage: Stage, h: mx.array, flags: wire.Run) -> wire.Reply | None:
        """A chunk of the prompt; the reply rank 0 waits for, if it waits for one."""
        begin, self.position = self.position, self.position + h.shape[1]
        if not flags & (wire.Run.SAMPLE | wire.Run.SCORE):
            return None
        if flags & wire.Run.SAMPLE:
            return self.pick(stage.logits(h))
        if self.picker is None:
            return self._failed()
        targets = self.prompt[begin + 1 : begin + h.shape[1] + 1]
        ids, lps = prompt_scores(stage.every_logits(h), targets, self.top_logprobs)
        return wire.Scores(ids, lps)

    def pick(self, logits: mx.array, forced: int | None = None) -> wire.Reply:
        """The next token from ``logits`` (1, vocab), or ``forced`` (rank 0's: a thinking
        budget's closing tag), which the picker takes unless its grammar refuses it."""
        if self.picker is None:
            return self._failed()
        if forced is not None:
            self.picker.forced.put([forced])
        try:
            token = self.picker.pick(logits)
        except InvalidRequest as exc:  # the grammar could not go on: the task fails
            self.picker, self.error = None, str(exc) or type(exc).__name__
            return self._failed()
        if token.logprob is None:
            return wire.Picked(token.id)
        ids = np.array([[token.id, *(i for i, _ in token.top)]], dtype=np.int32)
        lps = np.array([[token.logprob, *(lp for _, lp in token.top)]], dtype=np.float32)
        return wire.Picked(token.id, ids, lps)

    def _failed(self) -> wire.Reply:
        return wire.Failed(self.error or "the request could not start")
