"""`shoal models search`: the Hub's model search, against a stand-in for the Hub's API (these
tests have no network), and one clear line when the Hub cannot be reached."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from bus.embedded import free_port
from services.models.hub_search import HubModel, HubUnavailable, search_hub
from tests.services.models.test_cli_models import one_line_error, shoal

MODELS = [
    {"id": "Qwen/Qwen3-8B-GGUF", "downloads": 900, "likes": 50, "tags": ["gguf", "qwen3"]},
    {"id": "bartowski/Qwen3-8B-GGUF", "downloads": 400, "likes": 9, "tags": ["gguf"]},
]


class _HubApi(BaseHTTPRequestHandler):
    queries: ClassVar[list[dict[str, list[str]]]] = []

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        assert url.path == "/api/models"
        self.queries.append(parse_qs(url.query))
        body = json.dumps(MODELS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_search_asks_for_gguf_or_mlx_models_most_downloaded_first(hub: str) -> None:
    _HubApi.queries.clear()
    found = search_hub("qwen3 8b", endpoint=hub, limit=5)
    assert found == [
        HubModel(repo="Qwen/Qwen3-8B-GGUF", downloads=900, likes=50, gguf=True),
        HubModel(repo="bartowski/Qwen3-8B-GGUF", downloads=400, likes=9, gguf=True),
    ]
    query = _HubApi.queries[0]
    assert query["search"] == ["qwen3 8b"] and query["filter"] == ["gguf"]
    assert query["sort"] == ["downloads"] and query["limit"] == ["5"]
    assert found[0].add_command() == (
        "shoal models add qwen3-8b --hf Qwen/Qwen3-8B-GGUF --file FILE.gguf"
    )
    search_hub("qwen3", endpoint=hub, mlx=True)
    assert _HubApi.queries[1]["filter"] == ["mlx"]
    assert HubModel(repo="mlx-community/Qwen3-8B-4bit", mlx=True).add_command() == (
        "shoal models add qwen3-8b-4bit --hf mlx-community/Qwen3-8B-4bit --engine mlx"
    )


def test_an_unreachable_hub_is_one_clear_error() -> None:
    with pytest.raises(HubUnavailable, match="refused"):
        search_hub("qwen", endpoint=f"http://127.0.0.1:{free_port()}")


async def test_the_command_prints_what_it_found_or_one_line(hub: str) -> None:
    found, offline = await asyncio.gather(
        shoal("search", "qwen3", cache=None, env={"HF_ENDPOINT": hub}),
        shoal("search", "qwen3", cache=None, env={"HF_HUB_OFFLINE": "1"}),
    )
    assert found.returncode == 0, found.stderr
    assert "Qwen/Qwen3-8B-GGUF" in found.stdout and "--file FILE.gguf" in found.stdout
    one_line_error(offline, "cannot search the Hugging Face Hub", "HF_HUB_OFFLINE")
