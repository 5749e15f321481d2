"""The messages of an MLX pipeline's ring: the head's commands, which every rank passes on to the
next, and the last rank's replies to rank 0. The sockets they travel on are ``mlx_ring``; what
the ranks do with them is ``mlx_head`` and ``mlx_follower``.

A command is one record (``Start``, ``RunChunk``, ``Step``, ``Stop``, ``Shutdown``). On the
wire: five int32 words, the ``Command`` and the words its record names (the others zero), then
its payloads:

============  ==============================  ==============================================
command       header words                    payloads
============  ==============================  ==============================================
START         slot, JSON length               the ``StartRequest`` (JSON bytes)
RUN           slot, tokens, ``Run``, dtype    a prompt chunk's hidden states (1, tokens, hidden)
STEP          rows, dtype                     the batch's slots (int32, one a row), its hidden
                                              states (rows, 1, hidden)
STOP          slot
SHUTDOWN
============  ==============================  ==============================================

A reply is one record too (``Picked``, ``Scores``, ``Failed``, ``ShutdownAck``): one for a RUN
that asks for one, one a row for a STEP (in the rows' order), one for SHUTDOWN. On the wire:
four int32 words (the ``Answer``, a value, rows, width), then what it announces: a picked
token's (id, log-probability) pairs (int32 ids, float32 log-probabilities, the token first; the
value is its id), a chunk's prompt scores (the same, a row per position), an error's message
(UTF-8 bytes, the value their length: a grammar the text left), or nothing (a token without
log-probabilities, the shutdown acknowledgement).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, IntFlag

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, Field

from events.records import SamplingParams
from inference.decoding import Decoding, Token
from inference.engines.mlx.ring import PipelineBroken, Ring
from inference.engines.mlx.sampling import as_tokens
from structured.reply import Grammar, InvalidRequest


class Command(IntEnum):
    """What a message from a rank to the next is."""

    START = 1
    RUN = 2
    STOP = 3
    SHUTDOWN = 4
    STEP = 5


class Run(IntFlag):
    """What the last rank does with a RUN's hidden states, besides its KV cache."""

    SAMPLE = 1  # pick the next token from the last position; the sequence joins the batch
    SCORE = 2  # score the prompt's next token at every position (echo)


class Answer(IntEnum):
    """What a message from the last rank to rank 0 is."""

    TOKEN = 1
    SCORES = 2
    ERROR = 3
    SHUTDOWN_ACK = 4


DTYPES = (mx.float32, mx.float16, mx.bfloat16)  # a header's dtype word indexes this
NOT_FORCED = -1  # a STEP's row whose token is picked
HEADER_WORDS = 5
REPLY_WORDS = 4


# --- commands ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """START: a sequence begins in ``slot``; ``request`` is its ``StartRequest`` as JSON (the
    last rank reads it, the others pass it on as it came)."""

    slot: int
    request: bytes


@dataclass(frozen=True, eq=False)
class RunChunk:
    """RUN: a chunk of the prompt in ``slot``, as hidden states (1, tokens, hidden); ``flags``
    say whether the last rank answers."""

    slot: int
    hidden: mx.array
    flags: Run


@dataclass(frozen=True, eq=False)
class Step:
    """STEP: one token for every sequence of the decoding batch: its ``slots`` in row order,
    and the hidden states (rows, 1, hidden); ``forced``, a row's token the last rank takes
    instead of a pick (a thinking budget's closing tag, from rank 0's ``Decoding.forced``),
    ``NOT_FORCED`` for a row that picks (empty: none is forced)."""

    slots: list[int]
    hidden: mx.array
    forced: list[int] = field(default_factory=list)

    def forced_at(self, row: int) -> int | None:
        token = self.forced[row] if self.forced else NOT_FORCED
        return None if token == NOT_FORCED else token


@dataclass(frozen=True)
class Stop:
    """STOP: the sequence in ``slot`` ended; its slot is free."""

    slot: int


@dataclass(frozen=True)
class Shutdown:
    """SHUTDOWN: every rank stops following."""


Message = Start | RunChunk | Step | Stop | Shutdown


def send(ring: Ring, message: Message) -> None:
    """``message`` to the next rank: its header and its payloads, in order."""
    match message:
        case Start(slot, request):
            words, payloads = [Command.START, slot, len(request)], [_bytes_array(request)]
        case RunChunk(slot, hidden, flags):
            words = [Command.RUN, slot, hidden.shape[1], flags, _dtype_word(hidden)]
            payloads = [hidden]
        case Step(slots, hidden, forced):
            words = [Command.STEP, len(slots), _dtype_word(hidden)]
            forced = forced or [NOT_FORCED] * len(slots)
            payloads = [mx.array(slots, dtype=mx.int32), mx.array(forced, dtype=mx.int32), hidden]
        case Stop(slot):
            words, payloads = [Command.STOP, slot], []
        case Shutdown():
            words, payloads = [Command.SHUTDOWN], []
    ring.send(_words(words, HEADER_WORDS), *payloads)


def receive(ring: Ring, hidden_size: int) -> Message:
    """The next command from the previous rank, with its payloads; hidden states are
    ``hidden_size`` wide."""
    command, *words = (int(v) for v in np.array(ring.recv((HEADER_WORDS,), mx.int32)))
    match command:
        case Command.START:
            slot, length = words[:2]
            return Start(slot, np.array(ring.recv((length,), mx.uint8)).tobytes())
        case Command.RUN:
            slot, tokens, flags, dtype = words
            hidden = ring.recv((1, tokens, hidden_size), DTYPES[dtype])
            return RunChunk(slot, hidden, Run(flags))
        case Command.STEP:
            rows, dtype = words[:2]
            slots = [int(r) for r in np.array(ring.recv((rows,), mx.int32))]
            forced = [int(t) for t in np.array(ring.recv((rows,), mx.int32))]
            return Step(slots, ring.recv((rows, 1, hidden_size), DTYPES[dtype]), forced)
        case Command.STOP:
            return Stop(words[0])
        case Command.SHUTDOWN:
            return Shutdown()
    raise PipelineBroken(f"rank {ring.rank}: unknown command {command}")


# --- replies -----------------------------------------------------------------------------------

# Log-probabilities as ``mlx_sampling.as_tokens`` reads them: a row per token, the token and its
# alternatives.
Ids = npt.NDArray[np.int32]
Logprobs = npt.NDArray[np.float32]


@dataclass(frozen=True, eq=False)
class Picked:
    """TOKEN: the token picked, with its log-probabilities when they were asked (one row)."""

    token: int
    ids: Ids | None = None
    logprobs: Logprobs | None = None


@dataclass(frozen=True, eq=False)
class Scores:
    """SCORES: a prompt chunk's scores (echo), a row per position."""

    ids: Ids
    logprobs: Logprobs


@dataclass(frozen=True)
class Failed:
    """ERROR: the sequence cannot go on (a grammar it cannot follow); the ring can."""

    message: str


@dataclass(frozen=True)
class ShutdownAck:
    """SHUTDOWN_ACK: every rank has stopped following."""


Reply = Picked | Scores | Failed | ShutdownAck


def tokens(reply: Reply) -> list[Token]:
    """A reply's token or scores, as ``Token``s; raises ``InvalidRequest`` for an error."""
    match reply:
        case Failed(message):
            raise InvalidRequest(message)
        case Picked(token, ids, logprobs):
            return [Token(token)] if ids is None or logprobs is None else as_tokens(ids, logprobs)
        case Scores(ids, logprobs):
            return as_tokens(ids, logprobs)
        case ShutdownAck():
            raise PipelineBroken("a shutdown acknowledgement where a token was due")


def send_reply(ring: Ring, reply: Reply) -> None:
    """From the last rank to rank 0."""
    ids: Ids | None = None
    logprobs: Logprobs | None = None
    payloads: list[mx.array] = []
    match reply:
        case Picked(token, ids, logprobs):
            kind, value = Answer.TOKEN, token
        case Scores(ids, logprobs):
            kind, value = Answer.SCORES, 0
        case Failed(message):
            data = message.encode()
            kind, value, payloads = Answer.ERROR, len(data), [_bytes_array(data)]
        case ShutdownAck():
            kind, value = Answer.SHUTDOWN_ACK, 0
    rows, width = (0, 0)
    if ids is not None and logprobs is not None:
        rows, width = ids.shape
        payloads = [mx.array(ids.reshape(-1)), mx.array(logprobs.reshape(-1))]
    ring.send(_words([kind, value, rows, width], REPLY_WORDS), *payloads)


def receive_reply(ring: Ring) -> Reply:
    """On rank 0: the last rank's reply, with all it announces."""
    kind, value, rows, width = (int(v) for v in np.array(ring.recv((REPLY_WORDS,), mx.int32)))
    if kind == Answer.ERROR:
        message = np.array(ring.recv((value,), mx.uint8)).tobytes()
        return Failed(message.decode(errors="replace"))
    if kind == Answer.SHUTDOWN_ACK:
        return ShutdownAck()
    if kind not in (Answer.TOKEN, Answer.SCORES):
        raise PipelineBroken(f"rank {ring.rank}: unknown reply {kind}")
    if rows * width == 0:
        return Picked(value)
    ids = np.array(ring.recv((rows * width,), mx.int32)).reshape(rows, width)
    logprobs = np.array(ring.recv((rows * width,), mx.float32)).reshape(rows, width)
    return Picked(value, ids, logprobs) if kind == Answer.TOKEN else Scores(ids, logprobs)


# --- START's payload ---------------------------------------------------------------------------


class StartRequest(BaseModel):
    """START's payload: what the last rank needs to pick a request's tokens as one process
    would, and, with echo, the prompt it scores."""

    params: SamplingParams
    seed: int
    grammar: str | None = None
    triggers: list[str] = Field(default_factory=list)
    top_logprobs: int | None = None
    echo: bool = False
    prompt: list[int] = Field(default_factory=list)
    generated: list[int] = Field(default_factory=list)  # a resumed task's, before

    @classmethod
    def of(cls, decoding: Decoding, seed: int, prompt: list[int]) -> StartRequest:
        grammar = decoding.grammar
        return cls(
            params=decoding.params,
            seed=seed,
            grammar=grammar.gbnf if grammar is not None else None,
            triggers=list(grammar.triggers) if grammar is not None else [],
            top_logprobs=decoding.top_logprobs,
            echo=decoding.echo,
            prompt=prompt if decoding.echo else [],
            generated=list(decoding.generated),
        )

    def decoding(self) -> Decoding:
        grammar = Grammar(self.grammar, tuple(self.triggers)) if self.grammar is not None else None
        return Decoding(self.params, grammar, self.top_logprobs, self.echo, tuple(self.generated))


def _words(words: list[int], size: int) -> mx.array:
    return mx.array([*words, *[0] * (size - len(words))], dtype=mx.int32)


def _dtype_word(hidden: mx.array) -> int:
    return DTYPES.index(hidden.dtype)


def _bytes_array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))
