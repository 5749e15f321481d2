"""The output limit of a request that sets none (``--max-tokens``, a model's ``max_tokens`` in
``--model-defaults``): what Codex needs, which asks for no limit. An API process of its own with
both, beside the session's `shoal up`; each dialect's answer cut there as by its own limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.output_limit import with_default_max_tokens
from bus.embedded import free_port
from events.catalogue import TaskCreated
from events.records import SamplingParams
from harness.processes import SHOAL, wait_healthy
from harness.shoal_up import Drained, start
from tests.api.up_cluster import UpCluster

pytestmark = pytest.mark.slow

API_LIMIT = 6
MODEL_LIMIT = 4  # a model's own default: it wins over the API's


def test_a_request_s_own_limit_wins() -> None:
    def task(max_tokens: int | None) -> TaskCreated:
        params = SamplingParams(max_tokens=max_tokens)
        return TaskCreated(task_id="t", model_id="m", origin="t", prompt="x", params=params)

    assert with_default_max_tokens(task(None), 8).params.max_tokens == 8
    assert with_default_max_tokens(task(100), 8).params.max_tokens == 100
    assert with_default_max_tokens(task(None), None).params.max_tokens is None


@contextlib.contextmanager
def _api(up: UpCluster, *extra: str) -> Iterator[str]:
    """Another `shoal api` on the session's cluster, with ``extra`` options; its URL."""
    port = free_port("127.0.0.1")
    argv = [SHOAL, "api", "--nats", up.nats_url, "--db", up.db_url, "--port", str(port)]
    proc = Drained(start([*argv, "--api-key", up.key, "--no-load-on-demand", *extra]))
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url))
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def limited(up_cluster: UpCluster) -> Iterator[str]:
    with _api(up_cluster, "--max-tokens", str(API_LIMIT)) as url:
        yield url


def _post(url: str, key: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(
        f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


# A prompt a small model answers at length: each answer is cut by a limit, not ended by itself.
STORY = "Write a long story about the sea, with many boats."


def test_each_dialect_s_answer_is_cut_at_the_api_s_limit(
    up_cluster: UpCluster, limited: str
) -> None:
    key, model = up_cluster.key, up_cluster.model
    messages = [{"role": "user", "content": STORY}]
    chat = _post(limited, key, "/v1/chat/completions", {"model": model, "messages": messages})
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == API_LIMIT

    # The Responses API: complete, as llama-server's answer (a limit the request did not set
    # is no incomplete answer to a client that set none: Codex would fail the turn).
    responses = _post(limited, key, "/v1/responses", {"model": model, "input": STORY})
    assert responses["status"] == "completed" and responses["incomplete_details"] is None
    assert responses["usage"]["output_tokens"] == API_LIMIT
    own = {"model": model, "input": STORY, "max_output_tokens": API_LIMIT}
    responses = _post(limited, key, "/v1/responses", own)
    assert responses["status"] == "incomplete"  # its own limit
    assert responses["incomplete_details"] == {"reason": "max_output_tokens"}

    ollama = {"model": model, "messages": messages, "stream": False}
    answer = _post(limited, key, "/api/chat", ollama)
    assert answer["done_reason"] == "length" and answer["eval_count"] == API_LIMIT

    # The request's own limit wins, above the API's or below it.
    own = {"model": model, "messages": messages, "max_tokens": API_LIMIT + 3}
    chat = _post(limited, key, "/v1/chat/completions", own)
    assert chat["usage"]["completion_tokens"] == API_LIMIT + 3


def test_a_model_s_own_default_wins_over_the_api_s(up_cluster: UpCluster, tmp_path: Path) -> None:
    defaults = tmp_path / "defaults.json"  # by its alias: the model's, whatever name it is asked by
    defaults.write_text(json.dumps({up_cluster.alias: {"max_tokens": MODEL_LIMIT}}))
    extra = ("--max-tokens", str(API_LIMIT), "--model-defaults", str(defaults))
    with _api(up_cluster, *extra) as url:
        body = {"model": up_cluster.model, "messages": [{"role": "user", "content": STORY}]}
        chat = _post(url, up_cluster.key, "/v1/chat/completions", body)
        assert chat["usage"]["completion_tokens"] == MODEL_LIMIT
        assert chat["choices"][0]["finish_reason"] == "length"


def test_max_tokens_0_is_refused_at_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [SHOAL, "api", "--nats", "nats://127.0.0.1:1", "--max-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and "--max-tokens 0" in done.stderr
