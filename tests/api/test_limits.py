"""The guard at the API's edge (api/limits.py) and the bounded HTTP protocol
(api/http_protocol.py), in this process: the pure decisions, then the middleware driven with
hand-made ASGI messages (which say exactly what was read), then a real uvicorn with the
protocol on a loopback port. tests/api/test_edge.py runs the same against `shoal api`."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import pytest
import uvicorn
from starlette.datastructures import Headers
from starlette.types import Message, Receive, Scope, Send

from api import limits
from api.config import ApiConfig
from api.errors import Dialect
from api.hosts import host_policy
from api.http_protocol import bounded_httptools, connection_limit, refusal_bytes
from api.limits import (
    Limits,
    RequestGuard,
    _could_hold_surrogate,
    content_type_refusal,
    has_body,
    length_refusal,
    limits_of,
    needs_key,
    public_refusal,
    surrogate_refusal,
)
from bus.embedded import free_port

KEY = "key-1"
CHAT = "/v1/chat/completions"


# --- the pure decisions ---------------------------------------------------------------------


def test_a_length_over_the_limit_is_a_413_before_reading() -> None:
    assert length_refusal(None, 10) is None
    assert length_refusal("10", 10) is None
    err = length_refusal("314572800", 32)
    assert err is not None and err.status == 413 and err.code == "request_too_large"
    assert "314572800 bytes" in err.message and "at most 32 bytes" in err.message
    assert "--max-body" in err.message
    bad = length_refusal("12abc", 10)
    assert bad is not None and bad.status == 400


def test_has_body() -> None:
    assert not has_body(Headers({}))
    assert not has_body(Headers({"content-length": "0"}))
    assert not has_body(Headers({"content-length": "000"}))
    assert has_body(Headers({"content-length": "5"}))
    assert has_body(Headers({"transfer-encoding": "chunked"}))
    assert has_body(Headers({"content-length": "nope"}))  # then refused as such


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/x+json",
    ],
)
def test_json_bodies_pass(content_type: str) -> None:
    assert content_type_refusal("POST", CHAT, content_type, body=True) is None


@pytest.mark.parametrize(
    "content_type",
    [None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"],
)
def test_other_bodies_are_a_415(content_type: str | None) -> None:
    err = content_type_refusal("POST", CHAT, content_type, body=True)
    assert err is not None and err.status == 415 and err.code == "unsupported_media_type"
    assert "Content-Type: application/json" in err.message


def test_content_type_is_checked_only_on_bodies_that_routes_read() -> None:
    assert content_type_refusal("POST", CHAT, None, body=False) is None  # no body
    assert content_type_refusal("GET", "/api/tags", None, body=True) is None
    assert (
        content_type_refusal("POST", "/api/blobs/sha256:ab", "application/octet-stream", True)
        is None
    )
    for method in ("PUT", "PATCH", "DELETE"):
        assert content_type_refusal(method, "/api/delete", "text/plain", True) is not None


def test_paths_without_a_key() -> None:
    for path in ("/healthz", "/health", "/", "/static/dashboard.js", "/openapi.json", "/docs"):
        assert not needs_key(path), path
    for path in (CHAT, "/v1/models", "/api/chat", "/metrics", "/v1/events", "/nothing"):
        assert needs_key(path), path


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages.0.content"),
        (b'{"prompt": "x", "stop": ["ok", "\\uD83D"]}', "stop.1"),
        (
            b'{"tools": [{"function": {"parameters": {"\\udc00": 1}}}]}',
            "tools.0.function.parameters",
        ),
        ('{"model": "m\ud800"}'.encode("utf-8", "surrogatepass"), "model"),  # raw bytes
        (b'"\\ud800"', None),
        (b'{"a": "\\ud83d\\\\\\ude00"}', "a"),  # high, an escaped backslash, low: both lone
        (b'{"a": "x\\\\\\ud800"}', "a"),  # an escaped backslash, then the escape
        (b'{"a": ["\\ud83d\\ude00", "\\ud83d"]}', "a.1"),  # a pair, then a lone high
        ('{"input": "\ud800"}'.encode("utf-16", "surrogatepass"), "input"),  # UTF-16 JSON
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(body: bytes, param: str | None) -> None:
    err = surrogate_refusal(body)
    assert err is not None and err.status == 400 and err.param == param
    assert "lone UTF-16 surrogate" in err.message
    if param:
        assert err.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    "body",
    [
        b'{"content": "plain"}',
        b'{"content": "\\ud83d\\ude00 an emoji, escaped as a pair"}',
        '{"content": "\U0001f600 raw"}'.encode(),
        b'{"content": "\\\\ud800 is text here: the backslash is escaped"}',
        b'{"content": "caf\\u00e9"}',
        b"not json \\ud800",
        b"",
    ],
)
def test_text_without_a_lone_surrogate_passes(body: bytes) -> None:
    assert surrogate_refusal(body) is None


def test_the_surrogate_check_decodes_only_bodies_that_hint_at_one() -> None:
    """An ordinary body is passed after two byte searches, never decoded (its cost is in
    docs/api.md's limits); one with escapes is decoded, and a pair (an emoji) passes."""
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 400_000}]}).encode()
    assert not _could_hold_surrogate(body) and surrogate_refusal(body) is None
    emoji = json.dumps({"content": "hi \U0001f600"}).encode()  # an escaped pair
    assert _could_hold_surrogate(emoji) and surrogate_refusal(emoji) is None


def test_limits_of_a_config() -> None:
    limits = limits_of(
        ApiConfig(
            nats_url="nats://x",
            db_url="sqlite://",
            api_keys=frozenset({KEY}),
            cors_origins=("https://app.example",),
            listen_hosts=("127.0.0.1",),
            allowed_hosts=("shoal.example",),
            max_body_bytes=1000,
            body_timeout_s=3.0,
        )
    )
    assert limits.max_body_bytes == 1000 and limits.body_timeout_s == 3.0
    assert limits.api_keys == {KEY} and limits.cors_origins == ("https://app.example",)
    assert "shoal.example" in limits.hosts.names
    default = ApiConfig(nats_url="nats://x", db_url="sqlite://")
    assert default.max_body_bytes == 32 * 1024**2 and default.body_timeout_s == 30.0


def test_connection_limit() -> None:
    assert connection_limit(50) == 50
    assert connection_limit(None, open_files=1024) == 512
    assert connection_limit(None, open_files=256) == 128  # macOS's default
    assert connection_limit(None, open_files=1_048_576) == 1024
    assert connection_limit(None, open_files=20) == 32
    assert 32 <= connection_limit() <= 1024


# --- the middleware, with hand-made messages ------------------------------------------------


class Asgi:
    """One request through a ``RequestGuard`` over an app that records what it got."""

    def __init__(self, limits: Limits) -> None:
        self.bodies: list[bytes] = []
        self.pulled = 0  # messages the guard (or the app) took from the client

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            self.bodies.append(body)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        self.guard = RequestGuard(app, limits)

    async def call(
        self,
        path: str = CHAT,
        headers: dict[str, str] | None = None,
        chunks: Callable[[], AsyncIterator[bytes]] | None = None,
        method: str = "POST",
    ) -> tuple[int, dict[str, str], Any]:
        given = {"host": "127.0.0.1:8000"} | (headers or {})
        scope: Scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": [(k.encode(), v.encode("latin-1")) for k, v in given.items()],
        }
        stream = chunks() if chunks is not None else None

        async def receive() -> Message:
            self.pulled += 1
            if stream is None:
                return {"type": "http.request", "body": b"", "more_body": False}
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}

        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        await self.guard(scope, receive, send)
        start = sent[0]
        response_headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
        body = b"".join(m.get("body", b"") for m in sent[1:])
        parsed = json.loads(body) if body and body != b"ok" else body
        return start["status"], response_headers, parsed


def _json(n: int) -> dict[str, str]:
    return {"content-type": "application/json", "content-length": str(n)}


def _chunked() -> dict[str, str]:
    return {"content-type": "application/json", "transfer-encoding": "chunked"}


def _error(body: Any, dialect: Dialect) -> str:
    """The message of an error body, after checking its dialect's shape."""
    if dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return str(body["error"])
    if dialect == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return str(body["error"]["message"])
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return str(body["error"]["message"])


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _endless(chunk: int = 64 * 1024) -> AsyncIterator[bytes]:
    while True:
        yield b"x" * chunk


async def test_a_body_within_limits_reaches_the_app_whole_in_one_message() -> None:
    asgi = Asgi(Limits(max_body_bytes=100))
    body = b'{"model": "m"}'

    async def two() -> AsyncIterator[bytes]:
        yield body[:5]
        yield body[5:]

    status, _, answer = await asgi.call(headers=_chunked(), chunks=two)
    assert (status, answer) == (200, b"ok")
    assert asgi.bodies == [body]
    status, _, _ = await asgi.call(headers=_json(len(body)), chunks=lambda: _one(body))
    assert status == 200 and asgi.bodies[-1] == body


@pytest.mark.parametrize(
    ("path", "dialect"),
    [(CHAT, "openai"), ("/v1/messages", "anthropic"), ("/api/chat", "ollama")],
)
async def test_an_announced_length_over_the_limit_is_a_413_without_reading(
    path: str, dialect: Dialect
) -> None:
    asgi = Asgi(Limits(max_body_bytes=1000))
    status, headers, body = await asgi.call(path, _json(300 * 1024**2), chunks=_endless)
    assert status == 413 and asgi.pulled == 0 and not asgi.bodies
    assert headers["connection"] == "close"
    assert "314572800 bytes" in _error(body, dialect)
    if dialect == "anthropic":
        assert body["error"]["type"] == "request_too_large"


async def test_a_streamed_body_is_a_413_as_soon_as_it_passes_the_limit() -> None:
    asgi = Asgi(Limits(max_body_bytes=1024**2))
    status, headers, body = await asgi.call(headers=_chunked(), chunks=_endless)
    assert status == 413 and headers["connection"] == "close" and not asgi.bodies
    assert asgi.pulled == 1024**2 // (64 * 1024) + 1  # the chunk that passed it, no more
    assert body["error"]["code"] == "request_too_large"


async def test_a_slow_body_is_a_408_at_the_timeout() -> None:
    asgi = Asgi(Limits(body_timeout_s=0.5))

    async def trickle() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.05)
            yield b" "

    started = time.monotonic()
    status, headers, body = await asgi.call(headers=_chunked(), chunks=trickle)
    assert 0.5 <= time.monotonic() - started < 1.5
    assert status == 408 and headers["connection"] == "close" and not asgi.bodies
    assert body["error"]["code"] == "request_timeout" and "0.5 s" in body["error"]["message"]


async def test_a_client_gone_before_its_body_is_whole_gets_nothing() -> None:
    asgi = Asgi(Limits())
    sent: list[Message] = []
    messages: list[Message] = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [
        (b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
        (b"transfer-encoding", b"chunked"),
    ]}  # fmt: skip
    await asgi.guard(scope, receive, send)
    assert sent == [] and asgi.bodies == []


@pytest.mark.parametrize(
    ("auth", "dialect", "path"),
    [
        ({}, "openai", CHAT),
        ({"authorization": "Bearer wrong"}, "openai", CHAT),
        ({"x-api-key": "wrong"}, "anthropic", "/v1/messages"),
        ({"authorization": "Bearer café".encode().decode("latin-1")}, "ollama", "/api/chat"),
        (
            {"authorization": "Bearer \udcff".encode("utf-8", "surrogateescape").decode("latin-1")},
            "openai",
            CHAT,
        ),
    ],
)
async def test_without_the_key_a_401_before_the_body(
    auth: dict[str, str], dialect: Dialect, path: str
) -> None:
    asgi = Asgi(Limits(api_keys=frozenset({KEY})))
    headers = _json(300 * 1024**2) | auth
    status, answer_headers, body = await asgi.call(path, headers, chunks=_endless)
    assert status == 401 and asgi.pulled == 0
    assert answer_headers["www-authenticate"] == "Bearer"
    assert answer_headers["connection"] == "close"
    assert "API key" in _error(body, dialect)
    if dialect == "anthropic":
        assert body["error"]["type"] == "authentication_error"


async def test_with_the_key_or_on_open_paths_the_request_goes_on() -> None:
    asgi = Asgi(Limits(api_keys=frozenset({KEY})))
    for auth in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        status, _, _ = await asgi.call(CHAT, _json(2) | auth, chunks=lambda: _one(b"{}"))
        assert status == 200
    status, _, _ = await asgi.call("/healthz", method="GET")
    assert status == 200
    status, _, _ = await asgi.call("/", method="GET")
    assert status == 200


@pytest.mark.parametrize(
    ("path", "dialect"),
    [(CHAT, "openai"), ("/v1/messages", "anthropic"), ("/api/generate", "ollama")],
)
async def test_a_body_that_is_not_json_is_a_415(path: str, dialect: Dialect) -> None:
    asgi = Asgi(Limits())
    headers = {"content-type": "application/x-www-form-urlencoded", "content-length": "9"}
    status, answer_headers, body = await asgi.call(path, headers, chunks=lambda: _one(b"model=x&y"))
    assert status == 415 and asgi.pulled == 0
    assert answer_headers["connection"] == "close"
    assert "application/x-www-form-urlencoded" in _error(body, dialect)


async def test_a_host_not_allowed_is_a_400_saying_how_to_allow_it() -> None:
    asgi = Asgi(Limits(hosts=host_policy(["127.0.0.1"])))
    status, _, body = await asgi.call("/v1/models", {"host": "evil.example:8000"}, method="GET")
    assert status == 400 and not asgi.bodies
    message = _error(body, "openai")
    assert "'evil.example:8000'" in message and "--allowed-host evil.example" in message
    assert body["error"]["code"] == "host_not_allowed"
    status, _, body = await asgi.call("/api/tags", {"host": "[::2]:8000"}, method="GET")
    assert status == 400 and "--allowed-host ::2`" in _error(body, "ollama")


async def test_an_origin_not_allowed_is_a_403_before_anything() -> None:
    asgi = Asgi(Limits(api_keys=frozenset({KEY}), cors_origins=("https://app.example",)))
    headers = {"origin": "https://evil.example", "content-type": "text/plain"}
    status, _, body = await asgi.call(CHAT, headers | {"content-length": "2"}, lambda: _one(b"{}"))
    assert status == 403 and asgi.pulled == 0
    assert body["error"]["code"] == "origin_not_allowed"
    assert "--cors-origin https://evil.example" in body["error"]["message"]
    status, _, body = await asgi.call("/v1/messages", {"origin": "null"}, method="GET")
    assert status == 403 and body["error"]["type"] == "permission_error"
    # The API's own pages, an allowed origin, and no origin at all go on (to the key check).
    for origin in ({"origin": "http://127.0.0.1:8000"}, {"origin": "https://app.example"}, {}):
        status, _, _ = await asgi.call("/v1/models", origin, method="GET")
        assert status == 401


async def test_a_lone_surrogate_is_a_400_in_the_dialect() -> None:
    asgi = Asgi(Limits())
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    paths: list[tuple[str, Dialect]] = [
        (CHAT, "openai"),
        ("/v1/messages", "anthropic"),
        ("/api/chat", "ollama"),
    ]
    for path, dialect in paths:
        status, headers, body = await asgi.call(path, _json(len(raw)), lambda: _one(raw))
        assert status == 400 and "connection" not in headers  # the body was read: kept alive
        assert _error(body, dialect).startswith("messages.0.content: ")
    assert not asgi.bodies


def test_the_public_paths_take_get_and_head_without_a_body() -> None:
    assert public_refusal("GET", body=False) is None
    assert public_refusal("HEAD", body=False) is None
    for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
        err = public_refusal(method, body=False)
        assert err is not None and err.status == 405 and err.headers["Allow"] == "GET, HEAD"
    err = public_refusal("GET", body=True)
    assert err is not None and err.status == 413


@pytest.mark.parametrize("path", ["/health", "/healthz", "/", "/static/dashboard.js", "/docs"])
async def test_a_public_path_reads_no_body_and_answers_no_other_method(path: str) -> None:
    """Once these read and parsed any body before any key: a 32 MiB POST /health took 12 s of
    the event loop to refuse."""
    asgi = Asgi(Limits(api_keys=frozenset({KEY})))
    status, headers, body = await asgi.call(path, _json(32 * 1024**2), chunks=_endless)
    assert status == 405 and asgi.pulled == 0 and not asgi.bodies
    assert headers["allow"] == "GET, HEAD" and headers["connection"] == "close"
    assert body["error"]["code"] == "method_not_allowed"
    for framing in (_json(32 * 1024**2), _chunked()):
        status, headers, body = await asgi.call(path, framing, chunks=_endless, method="GET")
        assert status == 413 and asgi.pulled == 0 and not asgi.bodies
        assert headers["connection"] == "close"
    status, _, _ = await asgi.call(path, method="HEAD")
    assert status == 200


async def test_a_large_body_is_checked_for_surrogates_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parsing 32 MiB of JSON takes the loop a second: a large body is checked in a thread
    (a small one, in microseconds, where it is)."""
    threads: list[int] = []
    check = limits.surrogate_refusal

    def noted(body: bytes) -> Any:
        threads.append(threading.get_ident())
        return check(body)

    monkeypatch.setattr(limits, "surrogate_refusal", noted)
    asgi = Asgi(Limits())
    small = b'{"a": "\\ud800"}'
    large = b'{"a": "' + b"x" * limits.OFF_LOOP_BYTES + b'", "b": "\\ud800"}'
    for raw in (small, large):
        status, _, body = await asgi.call(CHAT, _json(len(raw)), partial(_one, raw))
        assert status == 400 and "lone UTF-16 surrogate" in body["error"]["message"]
    assert threads[0] == threading.get_ident() != threads[1]


# --- the HTTP protocol, in a real uvicorn ---------------------------------------------------


async def _hello(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


async def _serving(
    test: Callable[[int], Awaitable[None]], max_header_bytes: int, header_timeout_s: float
) -> None:
    port = free_port("127.0.0.1")
    config = uvicorn.Config(
        _hello,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        http=bounded_httptools(max_header_bytes, header_timeout_s),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        await test(port)
    finally:
        server.should_exit = True
        await task


async def _exchange(port: int, parts: list[bytes], pause_s: float = 0.0) -> bytes:
    """Send ``parts`` (pausing between them), then read until the server closes: with a
    plain socket, as HTTP clients read (asyncio's streams drop what came before a reset)."""

    def exchange() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for part in parts:
                try:
                    sock.sendall(part)
                except OSError:
                    break
                time.sleep(pause_s)
            answer = b""
            while True:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return answer
                if not data:
                    return answer
                answer += data

    return await asyncio.to_thread(exchange)


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """One whole answer of ``_hello`` (chunked)."""
    return await asyncio.wait_for(reader.readuntil(b"hello\r\n0\r\n\r\n"), 5)


async def test_headers_within_bounds_are_served_and_kept_alive() -> None:
    async def test(port: int) -> None:
        request = b"GET / HTTP/1.1\r\nHost: x\r\nX-Fill: " + b"a" * 3000 + b"\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):  # the same connection twice
            writer.write(request)
            head = await _answer(reader)
            assert head.startswith(b"HTTP/1.1 200")
        writer.close()

    await _serving(test, max_header_bytes=4096, header_timeout_s=5)


async def test_headers_too_large_are_a_431_and_closed() -> None:
    async def test(port: int) -> None:
        start = b"POST /api/chat HTTP/1.1\r\nHost: x\r\nX-Big: "
        answer = await _exchange(port, [start] + [b"a" * 8192] * 64)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head
        assert "4096 bytes" in json.loads(body)["error"]  # Ollama's shape: its path

    await _serving(test, max_header_bytes=4096, header_timeout_s=5)


async def test_headers_too_slow_are_a_408_and_closed() -> None:
    async def test(port: int) -> None:
        started = time.monotonic()
        parts = [b"GET /v1/models HTTP/1.1\r\n"] + [b"X-A: b\r\n"] * 40
        answer = await _exchange(port, parts, pause_s=0.05)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert 0.5 <= time.monotonic() - started < 2
        body = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_timeout"
        # A connection that sends nothing is closed without an answer.
        silent = await _exchange(port, [])
        assert silent == b""
        # A kept-alive connection's next request has its own time.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.7)  # idle, past the header timeout: not a request yet
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.close()

    await _serving(test, max_header_bytes=64 * 1024, header_timeout_s=0.5)


def test_refusal_bytes_are_a_whole_response() -> None:
    raw = refusal_bytes(431, "too large", "/v1/messages")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "too large"},
    }
