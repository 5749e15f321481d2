"""One image in, side by side in one run: llama.cpp's ``llama-server -m MODEL --mmproj PROJ``
and ``shoal up`` with the same model added with the same projector (``shoal models add ...
--mmproj``), the same GGUF files, the same threads, one slot each, both started and asked in
turns, round by round.

The model is the tests' SmolLM2-135M-Instruct with the tests' random-weight projector
(``harness/models/tiny_projector.py``: 64 image tokens, an encoder of 2 tiny blocks): no real
vision model runs here, what is measured is the path an image takes, which a real projector
only makes longer (its encoder's time, reported apart). Each round sends a new image (its
colours change), so that neither side answers from a prompt cache of the image.

For each: the time to the first streamed token of a one-image chat request, and the tokens/s
of the 48 tokens after it, medians of ``--rounds``. Target (issue 36): Shoal >= 0.9x
llama-server on both (TTFT: llama-server's / Shoal's).

    .venv/bin/python -m bench.vision
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from bench.common.llama_server import llama_server
from bench.common.processes import (
    add_model,
    gguf,
    shoal_env,
    shoal_up_argv,
    wait_http,
    wait_shoal_ready,
)
from bench.common.vision import SHOAL, measure, report
from bus.embedded import free_port
from harness.models.tiny_projector import write_tiny_projector
from harness.processes import Proc

MODEL = "smollm2-135m"
ANCHOR = "llama-server --mmproj"


@contextlib.asynccontextmanager
async def anchor(
    binary: Path, model: Path, projector: Path, threads: int, tmp: Path
) -> AsyncIterator[str]:
    """llama-server, started; its API's URL."""
    port = free_port("127.0.0.1")
    argv = [
        str(binary),
        "-m",
        str(model),
        "--mmproj",
        str(projector),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        "2048",
        "--parallel",
        "1",
        "--no-webui",
    ]
    proc = Proc(ANCHOR, argv, tmp / "llama-server.log")
    proc.start()
    try:
        await wait_http(proc, f"http://127.0.0.1:{port}/health", "health")
        yield f"http://127.0.0.1:{port}/v1"
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.astop()


@contextlib.asynccontextmanager
async def shoal(model: Path, projector: Path, threads: int, tmp: Path) -> AsyncIterator[str]:
    """`shoal up` with the model added with its projector; its API's URL."""
    port = free_port("127.0.0.1")
    data = tmp / "up"
    argv = shoal_up_argv(data, None, port, threads)
    proc = Proc(SHOAL, argv, tmp / "up.log")
    proc.start(shoal_env())
    try:
        await wait_shoal_ready(proc)
        await add_model(proc, data, MODEL, "--path", str(model), "--mmproj", str(projector))
        yield f"http://127.0.0.1:{port}/v1"
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.astop()


def encode_ms(log: Path) -> str:
    """llama-server's own figure for the image encoder (libmtmd logs it per image)."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "encoded in" in x]
    return lines[-1].strip() if lines else "not logged"


async def run(args: argparse.Namespace) -> int:
    binary = llama_server()
    with tempfile.TemporaryDirectory(prefix="shoal-vision-") as d:
        tmp = Path(d)
        model = gguf(MODEL, tmp)
        projector = tmp / "tiny-mmproj.gguf"
        write_tiny_projector(projector)
        print(
            f"# One image: {MODEL} with a random-weight projector"
            " (harness/models/tiny_projector.py),"
            f" {args.threads} threads, {args.rounds} rounds",
            file=sys.stderr,
        )
        async with (
            anchor(binary, model, projector, args.threads, tmp) as anchor_url,
            shoal(model, projector, args.threads, tmp) as shoal_url,
        ):
            urls = {ANCHOR: anchor_url, SHOAL: shoal_url}
            timings = await measure(urls, {ANCHOR: MODEL, SHOAL: MODEL}, args.rounds)
        print(f"llama-server's image encoder: {encode_ms(tmp / 'llama-server.log')}")
    return 0 if report(timings[ANCHOR], timings[SHOAL], ANCHOR) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, both sides")
    parser.add_argument("--rounds", type=int, default=10, help="requests measured, each side")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
