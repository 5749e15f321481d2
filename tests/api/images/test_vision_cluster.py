"""Images end to end: `shoal up --no-model` (NATS, projector, planner, worker, API), a model
with a projector file added with `shoal models add --mmproj`, then chats with images through
the real clients (OpenAI's SDK, Ollama's, Anthropic's), answered by a llama.cpp runner that
evaluates each image with libmtmd; and an MLX vision model (mlx-vlm's layout) added with
`shoal models add --engine mlx`, answered by an MLX runner through the same path.

No real vision model is run here: none can be had offline. The model is SmolLM2-135M-Instruct
with a projector of random weights made for it (``harness/models/tiny_projector.py``): an image
becomes 64 embeddings that depend on its pixels and mean nothing. What is shown is the whole
path (the image stored by digest, read by the runner, its 64 tokens counted in the usage, the
answer depending on the image: two images, two first-token distributions), not that anything is
seen. The MLX model is Gemma 3's architecture with random weights
(``harness/models/tiny_mlx_vision.py``), likewise.
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionContentPartParam,
    ChatCompletionUserMessageParam,
)

from bus.embedded import free_port
from harness.images import checkers_png, data_url, gradient_png
from harness.models.templated import SMOLLM2
from harness.models.tiny_mlx_vision import IMAGE_TOKENS as MLX_IMAGE_TOKENS
from harness.models.tiny_mlx_vision import make_tiny_mlx_vision_model
from harness.models.tiny_projector import IMAGE_TOKENS, write_tiny_projector
from harness.processes import SHOAL
from harness.shoal_up import Drained, read_until_ready, start
from tests.cli.shoal_up import KEY

pytestmark = pytest.mark.slow

MODEL = "smollm2-vision"
MLX_MODEL = "tiny-gemma3-vision-mlx"
QUESTION = "What is in this image?"


@dataclass(frozen=True)
class Seeing:
    base: str


def _add(nats_url: str, cache: Path, *argv: str) -> None:
    argv = (SHOAL, "models", "add", *argv)
    done = subprocess.run(
        [*argv, "--nats", nats_url, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr


async def _serving(base: str, model: str) -> None:
    """Ask for an instance of the model and wait until it answers a chat."""
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:
        asked = await client.post("/v1/instances", json={"model": model, "slots": 2})
        assert asked.status_code == 202, asked.text
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with asyncio.timeout(180):
            while (r := await client.post("/v1/chat/completions", json=chat)).status_code != 200:
                assert r.status_code == 503, r.text  # placed, loading
                await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def seeing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeing]:
    root = tmp_path_factory.mktemp("seeing")
    port = free_port("127.0.0.1")
    flags = ["--api-key", KEY, "--no-model", "--runner-threads", "1"]
    up = start([SHOAL, "up", "--data-dir", str(root / "data"), "--port", str(port), *flags])
    drained = None
    try:
        lines = asyncio.run(read_until_ready(up))
        drained = Drained(up)
        nats_url = next(x for x in lines if x.startswith("NATS")).split()[1]
        projector = write_tiny_projector(root / "mmproj-tiny.gguf")
        _add(nats_url, root / "cache", MODEL, "--path", str(SMOLLM2), "--mmproj", str(projector))
        mlx = make_tiny_mlx_vision_model(root / "tiny-mlx-vision")
        _add(nats_url, root / "cache", MLX_MODEL, "--path", str(mlx), "--engine", "mlx")
        base = f"http://127.0.0.1:{port}"
        asyncio.run(_serving(base, MODEL))
        asyncio.run(_serving(base, MLX_MODEL))
        yield Seeing(base)
    finally:
        if drained is not None:
            drained.stop()
        else:
            up.kill()


def _openai(seeing: Seeing) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{seeing.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ask(
    client: openai.OpenAI,
    image: bytes | None,
    top_logprobs: int | None = None,
    model: str = MODEL,
) -> ChatCompletion:
    """A chat of one question, after an image; at temperature 0, with the first token's
    log-probabilities when ``top_logprobs`` is given."""
    content: list[ChatCompletionContentPartParam] = [{"type": "text", "text": QUESTION}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
    message: ChatCompletionUserMessageParam = {"role": "user", "content": content}
    if top_logprobs is None:
        return client.chat.completions.create(
            model=model, messages=[message], temperature=0, max_tokens=4
        )
    return client.chat.completions.create(
        model=model,
        messages=[message],
        temperature=0,
        max_tokens=1,
        logprobs=True,
        top_logprobs=top_logprobs,
    )


def _first_token(client: openai.OpenAI, image: bytes, model: str) -> dict[str, float]:
    """The first token's top log-probabilities at temperature 0, after ``image``."""
    reply = _ask(client, image, top_logprobs=5, model=model)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    return {t.token: t.logprob for t in logprobs.content[0].top_logprobs}


def _anthropic_image(png: bytes) -> anthropic.types.ImageBlockParam:
    """Anthropic's image block of a PNG, as base64."""
    data = base64.b64encode(png).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_a_chat_with_an_image_is_answered_its_image_tokens_counted(seeing: Seeing) -> None:
    """OpenAI's SDK: the image's 64 tokens are in ``usage.prompt_tokens``; the model lists
    say the model reads images."""
    client = _openai(seeing)
    with_image = _ask(client, gradient_png())
    text_only = _ask(client, None)
    assert with_image.choices[0].message.content
    assert with_image.usage is not None and text_only.usage is not None
    assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    listed = {m.id: m for m in client.models.list()}
    assert (listed[MODEL].model_extra or {})["capabilities"] == ["completion", "vision"]
    shown = ollama.Client(host=seeing.base, headers={"Authorization": f"Bearer {KEY}"}).show(MODEL)
    assert "vision" in (shown.capabilities or [])


def test_two_images_give_two_first_token_distributions(seeing: Seeing) -> None:
    """At temperature 0, the first token's log-probabilities: the same image twice gives the
    same ones (the second time from the prompt cache), another image others."""
    client = _openai(seeing)
    gradient, checkers, again = (
        _first_token(client, png, MODEL) for png in (gradient_png(), checkers_png(), gradient_png())
    )
    assert gradient != pytest.approx(checkers, abs=1e-3)
    assert again == pytest.approx(gradient, abs=1e-3)


def test_an_mlx_vision_model_reads_images_through_the_same_path(seeing: Seeing) -> None:
    """The MLX runner (mlx-vlm's vision tower, mlx-lm's language model): the image's tokens
    counted (Gemma 3's: its 4 and the marks around them), two images two first-token
    distributions; Anthropic's image block reaches it as OpenAI's does; the lists say vision."""
    client = _openai(seeing)

    gradient = _first_token(client, gradient_png(), MLX_MODEL)
    assert gradient != pytest.approx(_first_token(client, checkers_png(), MLX_MODEL), abs=1e-3)
    with_image = _ask(client, gradient_png(), model=MLX_MODEL)
    text_only = _ask(client, None, model=MLX_MODEL)
    assert with_image.usage is not None and text_only.usage is not None
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens + MLX_IMAGE_TOKENS
    claude = anthropic.Anthropic(base_url=seeing.base, api_key=KEY, max_retries=0, timeout=120)
    image = _anthropic_image(gradient_png())
    answered = claude.messages.create(
        model=MLX_MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
    )
    used = answered.usage
    assert used.input_tokens + (used.cache_read_input_tokens or 0) == with_image.usage.prompt_tokens
    listed = {m.id: m for m in client.models.list()}
    assert (listed[MLX_MODEL].model_extra or {})["capabilities"] == ["completion", "vision"]


def test_ollama_s_and_anthropic_s_images_take_the_same_path(seeing: Seeing) -> None:
    """The other dialects' image shapes reach the same runner: the same 64 tokens more."""
    auth = {"Authorization": f"Bearer {KEY}"}
    client = ollama.Client(host=seeing.base, headers=auth, timeout=120)
    options = {"temperature": 0, "num_predict": 4}
    seen = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION, "images": [checkers_png()]}],
        options=options,
    )
    blind = client.chat(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], options=options
    )
    assert seen.message.content and seen.prompt_eval_count and blind.prompt_eval_count
    assert seen.prompt_eval_count == blind.prompt_eval_count + IMAGE_TOKENS

    claude = anthropic.Anthropic(base_url=seeing.base, api_key=KEY, max_retries=0, timeout=120)
    image = _anthropic_image(gradient_png())
    answered = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
    )
    text = claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": QUESTION}],
    )

    def prompt(usage: anthropic.types.Usage) -> int:  # Anthropic's: the cache's apart
        return usage.input_tokens + (usage.cache_read_input_tokens or 0)

    assert answered.content and prompt(answered.usage) == prompt(text.usage) + IMAGE_TOKENS
    # Counted without a task (the runner's tokenizer reads the image too): the same count.
    counted = claude.messages.count_tokens(
        model=MODEL,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],
    )
    assert counted.input_tokens == prompt(answered.usage)


def test_a_model_without_a_projector_refuses_an_image(seeing: Seeing) -> None:
    """A catalogue card that reads text only: a clear 400 before anything is loaded."""
    client = _openai(seeing)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(gradient_png())}}
                    ],
                }
            ],
        )
    assert "does not accept images" in str(refused.value)
