"""Embeddings through the `openai` SDK, unchanged, against one `shoal up` whose SmolLM2 has a
chat instance and an embed instance (mean-pooled: a generative model's embeddings, which
still run the whole path); and the refusals, against an API with no runner at all."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
from nats.js import JetStreamContext

from bus.publisher import Publisher
from events.catalogue import InstanceRequested, ModelAdded
from tests.api.conftest import ApiStack
from tests.api.up_cluster import UpCluster
from tests.cli.shoal_up import KEY

pytestmark = pytest.mark.slow

TEXTS = [
    "The cat sat on the mat.",
    "A kitten is sleeping on the rug.",
    "Stock markets fell sharply on Monday.",
]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def test_the_sdk_s_embeddings(up_cluster: UpCluster) -> None:
    # The SDK asks for base64 by default, and decodes it itself.
    got = client(up_cluster.base).embeddings.create(model=up_cluster.model, input=TEXTS)
    assert got.object == "list" and got.model == up_cluster.model
    assert [d.index for d in got.data] == [0, 1, 2]
    v = np.array([d.embedding for d in got.data])
    assert v.shape == (3, 576)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]  # the cat is closer to the kitten than to the markets
    assert got.usage.prompt_tokens == got.usage.total_tokens > 3 * 5


def test_float_and_base64_agree(up_cluster: UpCluster) -> None:
    sdk = client(up_cluster.base)
    floats = sdk.embeddings.create(model=up_cluster.model, input=TEXTS[0], encoding_format="float")
    raw = sdk.embeddings.create(model=up_cluster.model, input=TEXTS[0], encoding_format="base64")
    text = raw.data[0].embedding
    assert isinstance(text, str)
    decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
    assert np.allclose(decoded, floats.data[0].embedding, atol=1e-6)


def test_dimensions_token_ids_and_an_alias(up_cluster: UpCluster) -> None:
    sdk = client(up_cluster.second)  # the other API process serves it the same
    full = np.array(sdk.embeddings.create(model=up_cluster.model, input=TEXTS[1]).data[0].embedding)
    short = sdk.embeddings.create(model=up_cluster.alias, input=TEXTS[1], dimensions=64)
    assert short.model == up_cluster.alias  # the name the client sent
    cut = np.array(short.data[0].embedding)
    assert cut.shape == (64,)
    assert np.allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-5)
    # Token ids: the ones the model's tokenizer gives are the same input as the text.
    with httpx.Client(base_url=up_cluster.base, headers={"Authorization": f"Bearer {KEY}"}) as c:
        ids = [1, 504, 2644, 2643, 335, 260, 1171, 30]
        by_ids = c.post("/v1/embeddings", json={"model": up_cluster.model, "input": [ids, ids]})
        assert by_ids.status_code == 200, by_ids.text
        body = by_ids.json()
        assert len(body["data"]) == 2 and body["usage"]["prompt_tokens"] == 2 * len(ids)


def test_what_cannot_be_served_is_a_clear_400(up_cluster: UpCluster) -> None:
    sdk = client(up_cluster.base)
    with pytest.raises(openai.BadRequestError, match="dimensions is 1000, more than the model's"):
        sdk.embeddings.create(model=up_cluster.model, input="x", dimensions=1000)
    with pytest.raises(openai.BadRequestError, match="more than the 512 this embed instance"):
        sdk.embeddings.create(model=up_cluster.model, input="word " * 700)
    with pytest.raises(openai.BadRequestError, match="input"):
        sdk.embeddings.create(model=up_cluster.model, input=[])
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="no-such-model", input="x")


async def test_a_model_served_in_one_role_only_says_how_to_ask_for_the_other(
    api_stack: ApiStack, js: JetStreamContext
) -> None:
    """Instances as the log holds them (no runner is needed for the refusal)."""
    pub = Publisher(js)
    for model in ("chatty", "embeddy"):
        await pub.publish(ModelAdded(model_id=model, origin="test", n_layers=30, size_bytes=10**8))
    await pub.publish(InstanceRequested(instance_id="c", model_id="chatty", origin="t"))
    await pub.publish(
        InstanceRequested(instance_id="e", model_id="embeddy", origin="t", role="embed")
    )
    async with httpx.AsyncClient(base_url=api_stack.url) as c:
        for _ in range(100):  # until the projector has the instances
            r = await c.post("/v1/embeddings", json={"model": "chatty", "input": "x"})
            if r.status_code == 400:
                break
            await asyncio.sleep(0.1)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "model", r.text
        assert "served for chat only" in error["message"]
        assert 'POST /v1/instances {"model": "chatty", "role": "embed"}' in error["message"]
        assert "shoal instances create chatty --role embed" in error["message"]
        r = await c.post("/v1/embeddings", json={"model": "embeddy", "input": "x"})
        assert r.status_code == 503, r.text  # its embed instance waits to be placed
        hi = [{"role": "user", "content": "hi"}]
        r = await c.post("/v1/chat/completions", json={"model": "embeddy", "messages": hi})
        assert r.status_code == 400 and "served for embeddings only" in r.text
