"""Images out, end to end: `shoal up --no-model` (NATS, projector, planner, worker, API), the
tiny random-weight Stable Diffusion pipeline (``harness/models/tiny_diffusion.py``) added with
`shoal models add --path` (a diffusers directory: engine diffusers), an instance of it placed
and its runner loaded, then OpenAI's SDK, unchanged: ``client.images.generate``, whole and
streamed with partial images. The log holds the task (a ``TaskCreated`` of kind image), its
steps and its images (each an ``ImageGenerated`` that names its stored PNG).

No real image model can be had offline: what is shown is the path (the PNG of the asked size,
the same bytes for the same seed as the engine makes in process), not a picture of anything."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from nats.js.errors import NotFoundError
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
from PIL import Image

from bus.connection import connect
from bus.embedded import free_port
from bus.reader import read_stream
from bus.streams import CHUNKS_STREAM, EVENTS_STREAM
from events.catalogue import (
    Event,
    ImageGenerated,
    ImageStepped,
    TaskCompleted,
    TaskCreated,
    parse_event,
)
from harness.processes import SHOAL
from harness.shoal_up import Drained, read_until_ready, start
from tests.cli.shoal_up import KEY
from tests.tiny_diffusion import engine_pngs, tiny_diffusion_pipeline

pytestmark = pytest.mark.slow

MODEL = "tiny-sd"
PROMPT = "a photo of a red cat"


@dataclass(frozen=True)
class Painting:
    base: str
    nats_url: str


def _add(nats_url: str, cache: str, *argv: str) -> None:
    done = subprocess.run(
        [SHOAL, "models", "add", *argv, "--nats", nats_url, "--cache-dir", cache],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr


async def _serving(base: str) -> None:
    """Ask for an instance of the image model and wait until it answers."""
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
        asked = await client.post("/v1/instances", json={"model": MODEL})
        assert asked.status_code == 202, asked.text
        body = {"model": MODEL, "prompt": "x", "size": "64x64", "steps": 1}
        async with asyncio.timeout(240):
            while (r := await client.post("/v1/images/generations", json=body)).status_code != 200:
                assert r.status_code == 503, r.text  # placed, loading
                await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def painting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Painting]:
    root = tmp_path_factory.mktemp("painting")
    port = free_port("127.0.0.1")
    flags = ["--api-key", KEY, "--no-model", "--runner-threads", "1"]
    up = start([SHOAL, "up", "--data-dir", str(root / "data"), "--port", str(port), *flags])
    drained = None
    try:
        lines = asyncio.run(read_until_ready(up))
        drained = Drained(up)
        nats_url = next(x for x in lines if x.startswith("NATS")).split()[1]
        _add(nats_url, str(root / "cache"), MODEL, "--path", str(tiny_diffusion_pipeline()))
        base = f"http://127.0.0.1:{port}"
        asyncio.run(_serving(base))
        yield Painting(base, nats_url)
    finally:
        if drained is not None:
            drained.stop()
        else:
            up.kill()


def _client(painting: Painting) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{painting.base}/v1", api_key=KEY, max_retries=0, timeout=180)


def _in_process(seed: int, steps: int, size: tuple[int, int], n: int = 1) -> list[bytes]:
    """The engine's own images, in a process of its own with the runner's one thread."""
    return engine_pngs(PROMPT, n=n, width=size[0], height=size[1], steps=steps, seed=seed)


def test_the_sdk_gets_pngs_of_the_asked_size_the_engine_s_own_bytes(painting: Painting) -> None:
    """``client.images.generate``: two PNGs of 128 x 64, image i drawn with seed + i, each the
    bytes the engine makes in process for that seed."""
    made = _client(painting).images.generate(
        model=MODEL,
        prompt=PROMPT,
        n=2,
        size="128x64",  # (the SDK lists OpenAI's sizes; any WxH is sent)
        response_format="b64_json",
        extra_body={"seed": 11, "steps": 3},
    )
    assert made.data is not None and len(made.data) == 2
    pngs = [base64.b64decode(d.b64_json or "") for d in made.data]
    for png in pngs:
        image = Image.open(io.BytesIO(png))
        assert (image.format, image.size) == ("PNG", (128, 64))
    assert pngs == _in_process(11, 3, (128, 64), n=2)
    listed = {m.id: m for m in _client(painting).models.list()}
    assert (listed[MODEL].model_extra or {})["capabilities"] == ["image"]


def test_a_stream_gives_partial_images_then_each_finished_one(painting: Painting) -> None:
    """Two images, two partial ones each: each image's partials then its completed event, as
    it comes, with the steps it took as its usage."""
    stream = _client(painting).images.generate(
        model=MODEL,
        prompt=PROMPT,
        n=2,
        size="64x64",
        stream=True,
        partial_images=2,
        extra_body={"seed": 5, "steps": 4},
    )
    events = list(stream)
    partial, completed = "image_generation.partial_image", "image_generation.completed"
    assert [e.type for e in events] == [partial, partial, completed] * 2
    partials = [e for e in events if isinstance(e, ImageGenPartialImageEvent)]
    assert [e.partial_image_index for e in partials] == [0, 1, 0, 1]
    done = [e for e in events if isinstance(e, ImageGenCompletedEvent)]
    assert [base64.b64decode(e.b64_json) for e in done] == _in_process(5, 4, (64, 64), n=2)
    assert [e.usage.output_tokens for e in done] == [4, 4]


def test_a_url_answer_names_the_stored_png(painting: Painting) -> None:
    """``response_format: url``: the image at an address of this API, read back from where the
    runner stored it (with the key); a name that is no image's is a 404."""
    made = _client(painting).images.generate(
        model=MODEL, prompt=PROMPT, size="64x64", response_format="url", extra_body={"seed": 5}
    )
    assert made.data is not None and made.data[0].url is not None
    url = made.data[0].url
    assert url.startswith(f"{painting.base}/v1/images/files/") and url.endswith(".png")
    headers = {"Authorization": f"Bearer {KEY}"}
    fetched = httpx.get(url, headers=headers, timeout=30)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)
    assert httpx.get(url, timeout=30).status_code == 401  # a user key's, as the request was
    wrong = url.rsplit("/", 1)[0] + "/" + "0" * 64 + "-1-" + "0" * 64 + "-1-1.png"
    assert httpx.get(wrong, headers=headers, timeout=30).status_code == 404


def test_fields_the_engine_cannot_honour_are_a_400_naming_them(painting: Painting) -> None:
    client = _client(painting)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=MODEL, prompt=PROMPT, output_format="webp", style="vivid")
    message = str(refused.value)
    assert "output_format" in message and "style" in message
    with pytest.raises(openai.BadRequestError, match="width"):
        client.images.generate(model=MODEL, prompt=PROMPT, size="100x64")


def test_the_log_holds_the_task_its_steps_and_its_stored_images(painting: Painting) -> None:
    """The task is a TaskCreated of kind image with its parameters; its chunk subject has a
    step per denoising step and an ImageGenerated that names the PNG (no bytes in an event)."""
    _client(painting).images.generate(
        model=MODEL,
        prompt="a blue sea",
        size="64x64",
        extra_body={"seed": 3, "steps": 2},
    )

    async def read() -> tuple[TaskCreated, list[Event]]:
        nc = await connect(painting.nats_url)
        try:
            js = nc.jetstream()
            tasks = [
                e
                async for m in read_stream(js, EVENTS_STREAM, TaskCreated.filter_for(MODEL))
                if isinstance(e := parse_event(m.data), TaskCreated) and e.prompt == "a blue sea"
            ]
            task = tasks[-1]
            subject = ImageStepped.subject_for(task.task_id)
            chunks = [parse_event(m.data) async for m in read_stream(js, CHUNKS_STREAM, subject)]
            done = TaskCompleted.subject_for(MODEL, task.task_id)
            chunks.append(parse_event((await js.get_last_msg(EVENTS_STREAM, done)).data or b""))
            return task, chunks
        finally:
            await nc.close()

    task, chunks = asyncio.run(read())
    assert task.kind == "image" and task.image is not None
    assert (task.image.width, task.image.height, task.image.seed) == (64, 64, 3)
    steps = [c for c in chunks if isinstance(c, ImageStepped)]
    assert [(s.step, s.steps) for s in steps] == [(1, 2), (2, 2)]
    images = [c for c in chunks if isinstance(c, ImageGenerated)]
    assert len(images) == 1 and images[0].png.media_type == "image/png"
    assert len(images[0].to_json()) < 1000 < images[0].png.bytes  # named, not held
    completed = chunks[-1]
    assert isinstance(completed, TaskCompleted) and completed.usage.completion_tokens == 2


def test_a_client_that_goes_away_cancels_its_image_within_a_step(painting: Painting) -> None:
    """The client gives up after a second of a 150-step image: the API cancels the task, and
    the runner ends it after the step under way (its outcome says cancelled, its steps few)."""
    body = {"model": MODEL, "prompt": "a dog in the sea", "size": "256x256", "steps": 150}
    headers = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{painting.base}/v1/images/generations", json=body, headers=headers, timeout=1.5
        )

    async def outcome() -> TaskCompleted:
        nc = await connect(painting.nats_url)
        try:
            js = nc.jetstream()
            async with asyncio.timeout(60):
                while True:
                    tasks = [
                        e
                        async for m in read_stream(js, EVENTS_STREAM, TaskCreated.filter_for(MODEL))
                        if isinstance(e := parse_event(m.data), TaskCreated)
                        and e.prompt == "a dog in the sea"
                    ]
                    subject = TaskCompleted.subject_for(MODEL, tasks[-1].task_id)
                    try:
                        done = parse_event(
                            (await js.get_last_msg(EVENTS_STREAM, subject)).data or b""
                        )
                    except NotFoundError:
                        await asyncio.sleep(0.2)
                        continue
                    assert isinstance(done, TaskCompleted)
                    return done
        finally:
            await nc.close()

    done = asyncio.run(outcome())
    assert done.finish_reason == "cancelled"
    assert done.usage.completion_tokens < 150
