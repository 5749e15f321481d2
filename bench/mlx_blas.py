"""MLX on a CPU with OpenBLAS against the mlx[cpu] wheel's own reference BLAS, side by side.

    .venv/bin/python -m bench.mlx_blas [--rounds 1] [--threads 1]

SmolLM2-135M-Instruct (its GGUF dequantized to float32, as the suite runs it) in an
``MlxEngine`` with one slot, greedy: the first token of a ~1,400-token prompt (prefill) and
the tokens/s of up to 48 tokens after it. The BLAS is chosen before mlx is imported
(``inference/engines/mlx/blas.py``), so each measurement runs in a child process; the
two alternate, ``--rounds`` times each, and the medians are printed with their ratio.
Target: OpenBLAS's first token >= 5x sooner, and its tokens/s no lower than the wheel's BLAS's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.chat import LONG_TURN
from bench.common.report import verdict
from harness.models.templated import SMOLLM2

ANSWER_TOKENS = 48
CHOICES = {"reference": "the wheel's BLAS", "libopenblas.so.0": "OpenBLAS"}


def child(model_dir: Path, threads: int) -> dict[str, Any]:
    """In a child whose SHOAL_MLX_BLAS is set: the first token's seconds and tokens/s after."""
    from events.records import SamplingParams
    from inference.decoding import Decoding, Token
    from inference.engines.mlx.blas import blas_in_use
    from inference.engines.mlx.engine import MlxEngine

    engine = MlxEngine(model_dir, n_ctx=4096, slots=1, n_threads=threads)
    engine.load()
    chat = [{"role": "user", "content": f"{LONG_TURN}\nWhat did the diary say?"}]
    prompt = engine.chat_tokens(chat, None)
    generation = engine.generate(prompt, Decoding(SamplingParams(temperature=0)))
    started = time.perf_counter()
    times: list[float] = []
    for item in generation:
        if isinstance(item, Token):
            times.append(time.perf_counter())
            if engine.is_end(item.id) or len(times) > ANSWER_TOKENS:
                break
    generation.close()  # type: ignore[attr-defined]
    return {
        "blas": blas_in_use(),
        "prompt": len(prompt),
        "first": times[0] - started,
        "tps": (len(times) - 1) / (times[-1] - times[0]),
    }


def measure(choice: str, model_dir: Path, threads: int) -> dict[str, Any]:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.mlx_blas",
            "--child",
            str(model_dir),
            "--threads",
            str(threads),
        ],
        env={**os.environ, "SHOAL_MLX_BLAS": choice},
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.threads)))
        return 0
    from services.models.gguf_to_mlx import gguf_to_mlx

    seen: dict[str, list[dict[str, Any]]] = {c: [] for c in CHOICES}
    with tempfile.TemporaryDirectory(prefix="shoal-mlx-blas-") as d:
        model_dir = gguf_to_mlx(SMOLLM2, Path(d) / "smollm2-mlx")
        for _ in range(args.rounds):
            for choice in CHOICES:
                seen[choice].append(measure(choice, model_dir, args.threads))
    print(f"# MLX's BLAS: SmolLM2-135M float32, {args.threads} thread(s), medians of {args.rounds}")
    med = {
        c: {k: statistics.median(float(r[k]) for r in rs) for k in ("first", "tps")}
        for c, rs in seen.items()
    }
    for choice, name in CHOICES.items():
        runs = seen[choice]
        print(
            f"  {name:17} ({runs[0]['blas']}): first token of {int(runs[0]['prompt'])} tokens"
            f" {med[choice]['first'] * 1000:8.0f} ms, then {med[choice]['tps']:6.1f} tokens/s"
        )
    ref, open_ = med["reference"], med["libopenblas.so.0"]
    if "libopenblas" not in str(seen["libopenblas.so.0"][0]["blas"]):
        print("FAIL: no OpenBLAS here (apt install libopenblas0)")
        return 1
    sooner, faster = ref["first"] / open_["first"], open_["tps"] / ref["tps"]
    ok = sooner >= 5 and faster >= 1
    print(
        f"{verdict(ok)}: OpenBLAS's first token {sooner:.1f}x sooner (target >= 5x),"
        f" its tokens/s {faster:.2f}x the wheel's BLAS's (target >= 1x)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
