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

Messages from a rank to the next: a ``Header``, then for START the ``StartRequest`` (JSON bytes),
for RUN the hidden states (1, tokens, hidden). From the last rank to rank 0: a ``Reply`` header,
then what it announces: a picked token's (id, log-probability) pairs (int32 ids, float32
log-probabilities, the token first), a chunk's prompt scores (the same, a row per position), an
error's message (UTF-8 bytes: a grammar the text left), or nothing (a token without
log-probabilities, the shutdown acknowledgement).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import select
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from mlx.nn.layers.base import Module
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from pydantic import BaseModel, Field

from bus.events import SamplingParams
from services.runner.decoding import Decoding, Grammar, PromptScores, Token
from services.runner.engines.base import EngineBroken
from services.runner.engines.mlx import (
    MlxText,
    MlxTextEngine,
    context_length,
    load_model,
    prefill_chunks,
)
from services.runner.engines.mlx_sampling import (
    Grammars,
    Picker,
    as_tokens,
    check_decoding,
    prompt_scores,
    resolve_seed,
)
from services.runner.generation import InvalidRequest

log = logging.getLogger(__name__)

# Architectures whose forward pass is exactly: embedding, the decoder layers (each with its KV
# cache and the causal mask), final norm, output layer (or the tied embedding). Others (Gemma
# scales its embeddings, mixture-of-experts models route) would need their own stage code.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class Command(IntEnum):
    """What a message from a rank to the next is."""

    START = 1
    RUN = 2
    STOP = 3
    SHUTDOWN = 4


class Run(IntFlag):
    """What the last rank does with a RUN's hidden states, besides its KV cache."""

    SAMPLE = 1  # pick the next token from the last position
    SCORE = 2  # score the prompt's next token at every position (echo)


class Answer(IntEnum):
    """What a message from the last rank to rank 0 is."""

    TOKEN = 1
    SCORES = 2
    ERROR = 3
    SHUTDOWN_ACK = 4


_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# A closed connection (POLLRDHUP: the peer's FIN, where the system has it) or a broken one.
_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class PipelineBroken(EngineBroken):
    """The ring lost a rank (or this rank lost track of it): it cannot serve any more. The
    process should exit; the pipeline is restarted as a whole."""


@dataclass(frozen=True)
class PipelineShard:
    """One rank of a pipeline: its layers and the ring's addresses.

    ``hosts`` has one "ip:port" per rank, in rank order, the same list on every rank: rank ``r``
    listens on ``hosts[r]`` (binding that address only) and connects to ``hosts[r + 1]``. IPv4
    addresses only (mlx's ring opens AF_INET sockets)."""

    rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int
    hosts: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError("a pipeline has at least two ranks")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a pipeline of {self.world_size}")
        if len(self.hosts) != self.world_size:
            raise ValueError(f"{len(self.hosts)} hosts for {self.world_size} ranks")
        for host in self.hosts:
            ip, _, port = host.rpartition(":")
            if not ip or not port.isdigit():
                raise ValueError(f"host {host!r} is not ip:port")
        if not 0 <= self.start_layer < self.end_layer <= self.n_layers:
            raise ValueError(
                f"layers {self.start_layer}-{self.end_layer - 1} of a model of {self.n_layers}"
            )
        if self.first and self.start_layer != 0:
            raise ValueError("the first rank must start at layer 0")
        if self.last and self.end_layer != self.n_layers:
            raise ValueError("the last rank must end at the model's last layer")

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1


class Stage:
    """The part of the model one rank holds, and its forward pass."""

    def __init__(
        self,
        layers: list[Module],
        embed: Module | None,
        norm: Module | None,
        head: Module | None,
        *,
        tied: bool,
        hidden_size: int,
        sliding_window: int | None,
        config: dict[str, Any],
    ) -> None:
        self.layers = layers
        self.embed = embed
        self.norm = norm
        self.head = head
        self.hidden_size = hidden_size
        self.vocab_size = int(config["vocab_size"])
        self.config = config
        self._tied = tied
        self._window = sliding_window

    @classmethod
    def load(cls, model_dir: Path, shard: PipelineShard) -> Stage:
        """Only this rank's weights are read: the model is loaded lazily, the other layers are
        dropped before anything is evaluated."""
        model, config = load_model(model_dir)
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} cannot be split by this pipeline (supported: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        inner: Any = model["model"]
        all_layers: list[Module] = list(inner.layers)
        if len(all_layers) != shard.n_layers:
            raise ValueError(f"the model has {len(all_layers)} layers, not {shard.n_layers}")
        tied = bool(config.get("tie_word_embeddings", False))
        head: Module | None = None
        if shard.last:
            head = inner.embed_tokens if tied else model["lm_head"]
        stage = cls(
            layers=all_layers[shard.start_layer : shard.end_layer],
            embed=inner.embed_tokens if shard.first else None,
            norm=inner.norm if shard.last else None,
            head=head,
            tied=tied,
            hidden_size=int(config["hidden_size"]),
            sliding_window=getattr(inner, "sliding_window", None),
            config=config,
        )
        del model, inner, all_layers
        mx.eval(stage.parameters())
        return stage

    def parameters(self) -> list[Any]:
        modules = [*self.layers, self.embed, self.norm, self.head]
        return [m.parameters() for m in modules if m is not None]  # type: ignore[no-untyped-call]

    def new_cache(self) -> list[Any]:
        return [
            RotatingKVCache(max_size=self._window) if _sliding(layer) else KVCache()  # type: ignore[no-untyped-call]
            for layer in self.layers
        ]

    def hidden(self, x: mx.array, cache: list[Any]) -> mx.array:
        """Token ids (first rank) or the previous rank's hidden states, through this rank's
        layers. The same operations as mlx-lm's model, so the result is bit for bit the one of
        the whole model in one process."""
        h = self.embed(x) if self.embed is not None else x
        masks: dict[bool, Any] = {}
        for layer, c in zip(self.layers, cache, strict=True):
            sliding = _sliding(layer)
            if sliding not in masks:
                window = self._window if sliding else None
                masks[sliding] = create_attention_mask(h, c, window_size=window)
            h = layer(h, masks[sliding], cache=c)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """The last position's logits, shape (1, vocab); last rank only."""
        if self.norm is None or self.head is None:
            raise RuntimeError("only the last rank computes logits")
        out = self.norm(h[:, -1:, :])
        out = self.head.as_linear(out) if self._tied else self.head(out)
        logits: mx.array = out[:, -1, :]
        return logits

    def every_logits(self, h: mx.array) -> mx.array:
        """Every position's logits, shape (tokens, vocab); last rank only."""
        if self.norm is None or self.head is None:
            raise RuntimeError("only the last rank computes logits")
        out = self.norm(h)
        out = self.head.as_linear(out) if self._tied else self.head(out)
        logits: mx.array = out[0]
        return logits


def _sliding(layer: Module) -> bool:
    return bool(getattr(layer, "use_sliding", False))


class Ring:
    """This rank's place in mlx's ring: sends go to the next rank, receipts come from the
    previous one.

    mlx receives by polling its non-blocking socket in a loop: waiting for a message costs a
    whole core for as long as it takes (a follower between two requests would burn one for
    ever, and on a shared machine the waiting ranks slow the working one). So every receipt
    first waits for the socket to be readable with ``poll()`` (no CPU, GIL released), on
    ``incoming``, a duplicate of mlx's socket from the previous rank; mlx then finds the data
    there.

    mlx also does not survive a lost neighbour well: a receipt from a closed connection spins
    for ever (``recv()`` returning 0 is not an error to it), and after ten failed sends its
    socket's thread ends, so the next send on it never completes. So a lost neighbour is
    looked for here first, on ``incoming`` and on ``outgoing`` (a duplicate of mlx's socket to
    the next rank, on which the next rank never writes: readable means closed), and raises
    ``PipelineBroken`` without calling mlx."""

    def __init__(
        self,
        group: mx.distributed.Group,
        incoming: socket.socket | None,
        outgoing: socket.socket | None,
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._next = (self.rank + 1) % self.size
        self._prev = (self.rank - 1) % self.size
        # Both kept open for the polls.
        self._incoming = incoming
        self._outgoing = outgoing
        self._in_poll = _poller(incoming, select.POLLIN | select.POLLPRI | _HUNG_UP)
        self._out_poll = _poller(outgoing, _HUNG_UP)

    def _wait_readable(self, nbytes: int) -> None:
        """Wait until mlx has something to read; raises when the previous rank is gone and
        fewer than ``nbytes`` bytes of it are left (mlx would wait for the rest for ever)."""
        if self._in_poll is None or self._incoming is None:
            return
        while not (events := self._in_poll.poll()):
            pass
        if events[0][1] & _HUNG_UP and _buffered(self._incoming, nbytes) < nbytes:
            raise self._lost("receiving from", self._prev)

    def _check_next(self) -> None:
        if self._out_poll is not None and self._out_poll.poll(0):
            raise self._lost("sending to", self._next)

    def _lost(self, doing: str, peer: int) -> PipelineBroken:
        return PipelineBroken(
            f"rank {self.rank}: {doing} rank {peer}: the connection to a peer was lost"
        )

    def send(self, x: mx.array) -> None:
        self._check_next()
        try:
            mx.eval(mx.distributed.send(x, self._next, group=self.group))
        except RuntimeError as exc:
            raise PipelineBroken(f"rank {self.rank}: sending to rank {self._next}: {exc}") from exc

    def recv(self, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
        self._wait_readable(math.prod(shape) * dtype.size)
        try:
            x = mx.distributed.recv(shape, dtype, self._prev, group=self.group)
            mx.eval(x)
        except RuntimeError as exc:
            raise PipelineBroken(
                f"rank {self.rank}: receiving from rank {self._prev}: {exc}"
            ) from exc
        return x

    def send_message(self, header: Header | Reply, *payloads: mx.array) -> None:
        """The header and its payloads in one evaluation, each send made to depend on the one
        before: they leave in order, and nothing can come between them."""
        self._check_next()
        sent = mx.distributed.send(header.to_array(), self._next, group=self.group)
        for payload in payloads:
            after: Any = mx.depends(payload, sent)
            sent = mx.distributed.send(after, self._next, group=self.group)
        try:
            mx.eval(sent)
        except RuntimeError as exc:
            raise PipelineBroken(f"rank {self.rank}: sending to rank {self._next}: {exc}") from exc

    def recv_header(self) -> Header:
        return Header(*(int(v) for v in np.array(self.recv((4,), mx.int32))))

    def send_reply(self, reply: Reply) -> None:
        """From the last rank to rank 0."""
        if reply.ids is not None and reply.logprobs is not None:
            ids, lps = mx.array(reply.ids.reshape(-1)), mx.array(reply.logprobs.reshape(-1))
            self.send_message(reply, ids, lps)
        elif reply.kind == Answer.ERROR:
            self.send_message(reply, _bytes_array(reply.message.encode()))
        else:
            self.send_message(reply)

    def recv_reply(self) -> Reply:
        """On rank 0: the last rank's reply, with all it announces."""
        kind, value, rows, width = (int(v) for v in np.array(self.recv((4,), mx.int32)))
        if kind == Answer.ERROR:
            message = np.array(self.recv((value,), mx.uint8)).tobytes()
            return Reply(kind, message=message.decode(errors="replace"))
        if rows * width == 0:
            return Reply(kind, value)
        ids = np.array(self.recv((rows * width,), mx.int32)).reshape(rows, width)
        lps = np.array(self.recv((rows * width,), mx.float32)).reshape(rows, width)
        return Reply(kind, value, ids, lps)


@dataclass(frozen=True)
class Header:
    """A message from one rank to the next: ``command``; for START, ``extra`` is the length of
    the ``StartRequest`` JSON that follows; for RUN, ``tokens`` hidden states of dtype
    ``_DTYPES[dtype]`` follow, and ``extra`` holds the ``Run`` flags."""

    command: int
    tokens: int = 0
    extra: int = 0
    dtype: int = 0

    def to_array(self) -> mx.array:
        return mx.array([self.command, self.tokens, self.extra, self.dtype], dtype=mx.int32)


@dataclass(frozen=True)
class Reply:
    """A message from the last rank to rank 0 (``Answer``): a TOKEN (``value`` its id), a
    chunk's SCORES, an ERROR (``message``), the SHUTDOWN_ACK. ``ids`` and ``logprobs``, as
    ``mlx_sampling.as_tokens`` reads them: one row per token, the token and its alternatives;
    none for a token when no log-probabilities were asked. On the wire: four int32 (kind,
    value, rows, width; for an error, value is the message's length), then the int32 ids and
    the float32 log-probabilities, or the message."""

    kind: int
    value: int = 0
    ids: npt.NDArray[np.int32] | None = None
    logprobs: npt.NDArray[np.float32] | None = None
    message: str = ""

    def to_array(self) -> mx.array:
        if self.kind == Answer.ERROR:
            shape = (len(self.message.encode()), 0, 0)
        else:
            shape = (self.value, *(self.ids.shape if self.ids is not None else (0, 0)))
        return mx.array([self.kind, *shape], dtype=mx.int32)

    def tokens(self) -> list[Token]:
        """The scores or token, as ``Token``s; raises ``InvalidRequest`` for an error."""
        if self.kind == Answer.ERROR:
            raise InvalidRequest(self.message)
        if self.ids is None or self.logprobs is None:
            return [Token(self.value)]
        return as_tokens(self.ids, self.logprobs)


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

    @classmethod
    def of(cls, decoding: Decoding, seed: int, prompt: list[int]) -> StartRequest:
        grammar = decoding.grammar
        return cls(
            params=decoding.params, seed=seed,
            grammar=grammar.gbnf if grammar is not None else None,
            triggers=list(grammar.triggers) if grammar is not None else [],
            top_logprobs=decoding.top_logprobs, echo=decoding.echo,
            prompt=prompt if decoding.echo else [],
        )  # fmt: skip

    def decoding(self) -> Decoding:
        grammar = Grammar(self.grammar, tuple(self.triggers)) if self.grammar is not None else None
        return Decoding(self.params, grammar, self.top_logprobs, self.echo)


def _poller(sock: socket.socket | None, events: int) -> select.poll | None:
    if sock is None:
        return None
    poll = select.poll()
    poll.register(sock, events)
    return poll


def _buffered(sock: socket.socket, up_to: int) -> int:
    """How many bytes (at most ``up_to``) wait to be read on ``sock``."""
    try:
        return len(sock.recv(up_to, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, ConnectionError):
        return 0


def _bytes_array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))


def connect(shard: PipelineShard, timeout: float) -> Ring:
    """Join the ring; blocks until every rank has.

    mlx forms the ring in a chain: the last rank connects to rank 0, rank 0 accepts it and
    connects to rank 1, which accepts and connects to rank 2, and so on. A rank accepts with no
    time limit, and connects for about 30 s before it gives up. The last rank's first
    connection is retried here until ``timeout`` (nothing else has happened yet), so rank 0 may
    join any time within it; any other rank must join at most about 30 s after its previous
    rank did. mlx waits holding the GIL, which no Python code can interrupt: past ``timeout``
    seconds the process is ended (exit status 1, tracebacks on stderr; this uses faulthandler's
    one timer).

    mlx reads the hostfile and the rank from the environment, and keeps the first ring a
    process joins: one pipeline rank per process."""
    deadline = time.monotonic() + timeout
    stderr = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
    with _hostfile(shard.hosts) as hostfile:
        os.environ["MLX_HOSTFILE"] = hostfile
        os.environ["MLX_RANK"] = str(shard.rank)
        faulthandler.dump_traceback_later(timeout, exit=True, file=stderr)
        try:
            while True:
                try:
                    group = mx.distributed.init(strict=True, backend="ring")
                    break
                except RuntimeError as exc:
                    if not (shard.last and "connect" in str(exc) and time.monotonic() < deadline):
                        raise PipelineBroken(f"rank {shard.rank}: joining the ring: {exc}") from exc
                    log.info("rank %d: rank 0 is not listening yet, trying again", shard.rank)
        finally:
            faulthandler.cancel_dump_traceback_later()
    if group.rank() != shard.rank or group.size() != shard.world_size:
        raise PipelineBroken(
            f"joined a ring as rank {group.rank()} of {group.size()}, not {shard.rank} of "
            f"{shard.world_size} (mlx keeps the first ring a process joins)"
        )
    incoming, outgoing = _ring_sockets(shard)
    if incoming is None:
        log.warning("rank %d: mlx's socket not found: waiting for messages spins", shard.rank)
    for sock in (incoming, outgoing):
        if sock is not None:
            _keep_alive(sock)
    return Ring(group, incoming, outgoing)


@contextmanager
def _hostfile(hosts: Sequence[str]) -> Iterator[str]:
    """mlx's hostfile (one list of addresses per rank), as a path for as long as the block
    runs. In memory where the system allows (Linux), so that a process ended while it waits
    for the ring leaves no file behind."""
    data = json.dumps([[host] for host in hosts]).encode()
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("shoal-mlx-hostfile")
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="shoal-mlx-ring-") as directory:
        path = Path(directory) / "hosts.json"
        path.write_bytes(data)
        yield str(path)


def _ring_sockets(shard: PipelineShard) -> tuple[socket.socket | None, socket.socket | None]:
    """Duplicates of mlx's two sockets: the one the previous rank connected to (accepted on
    this rank's address) and the one to the next rank. mlx does not expose them; they are
    found among this process's file descriptors by their addresses."""
    mine = _address(shard.hosts[shard.rank])
    following = _address(shard.hosts[(shard.rank + 1) % shard.world_size])
    incoming: socket.socket | None = None
    outgoing: socket.socket | None = None
    fds = os.listdir("/dev/fd") if os.path.isdir("/dev/fd") else []
    for fd in fds:
        sock = _tcp_socket(int(fd))
        if sock is None:
            continue
        # The outgoing socket first: its peer's address is unique to it.
        if outgoing is None and _endpoint(sock.getpeername) == following:
            outgoing = sock
        elif incoming is None and _endpoint(sock.getsockname) == mine:
            incoming = sock
        else:
            sock.close()
    return incoming, outgoing


def _tcp_socket(fd: int) -> socket.socket | None:
    """A duplicate of this process's file descriptor ``fd`` if it is a TCP/IPv4 socket."""
    try:
        copy = os.dup(fd)
    except OSError:  # closed meanwhile
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:  # not a socket
        os.close(copy)
        return None
    if sock.type == socket.SOCK_STREAM and sock.family == socket.AF_INET:
        return sock
    sock.close()
    return None


def _endpoint(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except OSError:  # not connected
        return None


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalive and a send timeout: a neighbour whose machine vanishes without closing
    its connections (power, network) is then noticed within about 30 s, as a lost connection,
    instead of never."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 30_000)
    except OSError as exc:
        log.warning("no keepalive on the ring's socket: %s", exc)


def _address(host: str) -> tuple[str, int]:
    ip, _, port = host.rpartition(":")
    return socket.gethostbyname(ip), int(port)


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
            ring.send_message(Header(Command.START, extra=len(start)), _bytes_array(start))
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
        header = Header(Command.RUN, len(tokens), int(flags), _DTYPES.index(h.dtype))
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
                h = stage.hidden(ring.recv(shape, _DTYPES[header.dtype]), request.cache)
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
