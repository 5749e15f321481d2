"""One image in, on MLX, side by side in one run: mlx-vlm's own server (``python -m
mlx_vlm.server --model DIR``) and ``shoal up`` with the same model directory added for the MLX
engine (``shoal models add ... --engine mlx``), one sequence each, both started and asked in
turns, round by round (``bench/vision.py``'s rounds, requests and table).

The model is Gemma 3's architecture with random weights in mlx-vlm's layout
(``harness/models/tiny_mlx_vision.py``), at about SmolLM2-135M's size: a 576-wide language
model of 30 layers, a 6-layer SigLIP tower of width 384 reading a 224x224 image as 256
patches, pooled into 64 image tokens. No real vision model runs here (none can be downloaded);
what is measured is the path an image takes on MLX: mlx-vlm's processor and vision tower on
both sides, then Shoal's engine (mlx-lm's language model, fed the image's rows) against
mlx-vlm's own generation. Each round sends a new image, so neither side answers from a cache.

Target (issue 36, as for llama.cpp): Shoal >= 0.9x the anchor on the first token and on the
tokens/s after it.

    .venv/bin/python -m bench.mlx_vision
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from bench.common.processes import add_model, shoal_env, shoal_up_argv, wait_http, wait_shoal_ready
from bench.common.vision import SHOAL, measure, report
from bus.embedded import free_port
from harness.models.tiny_mlx_vision import make_tiny_mlx_vision_model
from harness.processes import Proc

ANCHOR = "mlx_vlm.server"
MODEL = "gemma3-random-vision"


@contextlib.asynccontextmanager
async def anchor(model: Path, tmp: Path) -> AsyncIterator[tuple[str, str]]:
    """mlx-vlm's server, started with the model; its API's URL and the model's name there."""
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "mlx_vlm.server", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "1"]
    proc = Proc(ANCHOR, argv, tmp / "mlx-vlm.log")
    proc.start()
    try:
        await wait_http(proc, f"http://127.0.0.1:{port}/health", "health")
        yield f"http://127.0.0.1:{port}/v1", str(model)
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.astop()


@contextlib.asynccontextmanager
async def shoal(model: Path, tmp: Path) -> AsyncIterator[str]:
    """`shoal up` with the model directory added for the MLX engine; its API's URL."""
    port = free_port("127.0.0.1")
    data = tmp / "up"
    proc = Proc(SHOAL, shoal_up_argv(data, None, port, 1), tmp / "up.log")
    proc.start(shoal_env())
    try:
        await wait_shoal_ready(proc)
        await add_model(proc, data, MODEL, "--path", str(model), "--engine", "mlx")
        yield f"http://127.0.0.1:{port}/v1"
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.astop()


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="shoal-mlx-vision-") as d:
        tmp = Path(d)
        model = make_tiny_mlx_vision_model(
            tmp / MODEL,
            hidden_size=576,
            n_layers=30,
            vision_hidden_size=384,
            vision_layers=6,
            image_size=224,
            image_tokens=64,
        )
        print(
            f"# One image on MLX: {MODEL} (random weights, 64 image tokens), {args.rounds} rounds",
            file=sys.stderr,
        )
        async with anchor(model, tmp) as (anchor_url, anchor_model), shoal(model, tmp) as url:
            # The anchor knows the model by its path, Shoal by its name.
            urls = {ANCHOR: anchor_url, SHOAL: url}
            timings = await measure(urls, {ANCHOR: anchor_model, SHOAL: MODEL}, args.rounds)
    return 0 if report(timings[ANCHOR], timings[SHOAL], ANCHOR) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="requests measured, each side")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
