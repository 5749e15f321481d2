"""Images out: one image through Shoal's ``POST /v1/images/generations`` against the same
diffusers engine called in this process, same pipeline, size, steps, seed and threads, side by
side in one run.

    .venv/bin/python -m bench.images [--rounds 10] [--steps 4] [--size 256] [--threads 1]

The pipeline is the tiny random-weight Stable Diffusion of the tests
(``harness/models/tiny_diffusion.py``: a real UNet, VAE and CLIP text encoder at toy widths);
no real image model can be had offline. What is measured is what Shoal adds around the engine:
the task through the log, the runner, a step event per step, the PNG stored by digest and read
back, base64 in JSON.

- in-process: ``DiffusersEngine.generate`` (``inference/engines/diffusion``), timed around the
  call (PNG bytes out);
- Shoal: `shoal up --no-model --runner-threads N`, the pipeline added with `shoal models add
  --path`, an instance asked for; ``POST /v1/images/generations`` with ``b64_json``, timed at
  the client from just before the request to the decoded PNG; then, once, the same streamed
  with one partial image, for the time to its first partial image.

They run in turn, never at the same time, after one warm-up each. Reported: the median seconds
per image and per step of each, and the ratio of in-process seconds to Shoal's (Shoal's speed
as a fraction of the engine's; target >= 0.95x). Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from bench.common.processes import add_model, shoal_env, shoal_up_argv, wait_shoal_ready
from bench.common.report import verdict
from bus.embedded import free_port
from events.records import ImageParams
from harness.models.tiny_diffusion import make_tiny_diffusion_pipeline
from harness.processes import Proc
from inference.engines.diffusion.engine import DiffusersEngine

TARGET = 0.95
MODEL = "tiny-sd"
PROMPT = "a photo of a red cat"


@contextlib.asynccontextmanager
async def shoal(model: Path, tmp: Path, threads: int) -> AsyncIterator[str]:
    """`shoal up` with the pipeline added and an instance of it serving; its API's URL."""
    port = free_port("127.0.0.1")
    data = tmp / "up"
    proc = Proc("shoal up", shoal_up_argv(data, None, port, threads), tmp / "up.log")
    proc.start(shoal_env())
    try:
        await wait_shoal_ready(proc)
        await add_model(proc, data, MODEL, "--path", str(model))
        url = f"http://127.0.0.1:{port}/v1"
        async with httpx.AsyncClient(timeout=300) as client:
            asked = await client.post(f"{url}/instances", json={"model": MODEL})
            asked.raise_for_status()
            body = {"model": MODEL, "prompt": "x", "size": "64x64", "steps": 1}
            async with asyncio.timeout(300):
                while True:  # placed, loading: 503 until its runner is Ready
                    r = await client.post(f"{url}/images/generations", json=body)
                    if r.status_code == 200:
                        break
                    await asyncio.sleep(0.5)
        yield url
    except Exception:
        print(proc.log()[-3000:], file=sys.stderr)
        raise
    finally:
        await proc.astop()


async def through_shoal(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> float:
    start = time.perf_counter()
    r = await client.post(f"{url}/images/generations", json=body)
    r.raise_for_status()
    base64.b64decode(r.json()["data"][0]["b64_json"])
    return time.perf_counter() - start


async def first_partial(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> float:
    """Seconds from the request to its first partial image's event, streamed."""
    start = time.perf_counter()
    streamed = {**body, "stream": True, "partial_images": 1}
    async with client.stream("POST", f"{url}/images/generations", json=streamed) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("event: image_generation.partial_image"):
                return time.perf_counter() - start
    raise RuntimeError("no partial image came")


async def run(args: argparse.Namespace) -> int:
    size = args.size
    with tempfile.TemporaryDirectory(prefix="shoal-images-") as d:
        tmp = Path(d)
        model = make_tiny_diffusion_pipeline(tmp / MODEL)
        engine = DiffusersEngine(model, n_threads=args.threads)
        engine.load()
        params = ImageParams(width=size, height=size, steps=args.steps, seed=1)

        def in_process() -> float:
            start = time.perf_counter()
            engine.generate(PROMPT, params, lambda _p: None, lambda: False)
            return time.perf_counter() - start

        body: dict[str, object] = {
            "model": MODEL,
            "prompt": PROMPT,
            "size": f"{size}x{size}",
            "steps": args.steps,
            "seed": 1,
            "response_format": "b64_json",
        }
        local: list[float] = []
        served: list[float] = []
        async with shoal(model, tmp, args.threads) as url, httpx.AsyncClient(timeout=300) as c:
            in_process()
            await through_shoal(c, url, body)  # warm-ups
            for _ in range(args.rounds):
                local.append(in_process())
                served.append(await through_shoal(c, url, body))
            partial = await first_partial(c, url, {**body, "steps": max(args.steps, 2)})
    mine, theirs = statistics.median(served), statistics.median(local)
    ratio = theirs / mine
    print(f"# {size}x{size}, {args.steps} steps, {args.threads} thread(s), {args.rounds} rounds")
    print(f"in-process  {theirs:.3f} s/image  {theirs / args.steps * 1000:.1f} ms/step")
    print(f"Shoal       {mine:.3f} s/image  {mine / args.steps * 1000:.1f} ms/step")
    print(
        f"Shoal's speed: {ratio:.2f}x in-process (target >= {TARGET}x) {verdict(ratio >= TARGET)}"
    )
    print(f"first partial image, streamed: {partial:.3f} s")
    return 0 if ratio >= TARGET else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="images measured, each side")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=256, help="pixels a side")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch's threads, each side")
    return asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
