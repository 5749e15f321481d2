"""One MLX model split by layers across processes (pipeline parallel), over mlx's ring backend.

Rank ``r`` holds only layers ``start_layer..end_layer`` of the model; rank 0 also the token
embedding, the last rank the final norm and the output layer (and the embedding too when the
output layer is tied to it). The ranks form mlx's TCP ring (``mx.distributed``, backend
"ring"): each rank sends to the next one and receives from the previous one, and the last rank's
"next" is rank 0.

Rank 0 (``PipelineHead``, in ``mlx_head``) is an ``Engine``: the runner's TaskServer serves
tasks with it as with a single-process engine, up to ``slots`` at once. Every rank keeps the
same sequences in the same slots (``mlx_stage.StageCaches``), and each command from rank 0
changes them alike:

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
(``PipelineFollower``, in ``mlx_follower``) run ``follow()`` until rank 0 sends SHUTDOWN; if the
connection to a neighbour is lost, ``follow()`` raises ``PipelineBroken``.

A rank's layers and caches are ``mlx_stage``; the ring and its sockets ``mlx_ring``; the
commands and replies ``mlx_wire``; admission and the sinks the shared ``batch_loop``'s. This
module runs a rank > 0 as a process of its own (``main``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from inference.engines.mlx.follower import PipelineFollower
from inference.engines.mlx.ring import PipelineBroken, PipelineShard

log = logging.getLogger(__name__)


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
    log.info(
        "rank %d of %d: layers %d-%d, in the ring",
        shard.rank,
        shard.world_size,
        shard.start_layer,
        shard.end_layer - 1,
    )
    try:
        follower.follow()
    except PipelineBroken as exc:
        log.error("%s", exc)
        return 1
    log.info("rank %d: shut down after %d requests", shard.rank, follower.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
