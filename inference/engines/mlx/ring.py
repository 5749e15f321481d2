"""The ring of an MLX pipeline: which rank holds what (``PipelineShard``), joining mlx's TCP ring
(``connect``), and sending and receiving arrays on it (``Ring``), with a lost neighbour seen on
the sockets before mlx is called. The messages the ranks send each other are ``mlx_wire``.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from inference.engines.base import EngineBroken

log = logging.getLogger(__name__)


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

    def send(self, header: mx.array, *payloads: mx.array) -> None:
        """A message: ``header`` and its ``payloads`` in one evaluation, each send made to
        depend on the one before, so they leave in order and nothing can come between them."""
        self._check_next()
        sent = mx.distributed.send(header, self._next, group=self.group)
        for payload in payloads:
            after: Any = mx.depends(payload, sent)
            sent = mx.distributed.send(after, self._next, group=self.group)
        try:
            mx.eval(sent)
        except RuntimeError as exc:
            raise PipelineBroken(f"rank {self.rank}: sending to rank {self._next}: {exc}") from exc


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
