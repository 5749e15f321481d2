"""The API's edge against a real `shoal api` process (with a real projector and nats-server):
bodies too large or too slow, requests without a key, hosts, origins and content types, lone
surrogates, headers too large, and `shoal api` refusing to listen beyond loopback unlocked.
The same rules, in this process and with hand-made messages: tests/api/test_limits.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest

from api.errors import Dialect
from bus.embedded import free_port
from events.units import MiB
from harness.memory import PeakRss
from harness.processes import SHOAL, wait_healthy
from tests.api.conftest import ApiStack, running_api_stack

KEY = "edge-key-1"
CHAT = "/v1/chat/completions"
HUGE = 300 * MiB  # bytes
DEFAULT_LIMIT = 32 * MiB
TIMEOUT_S = 2.0  # the --body-timeout of the APIs that test it


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiStack]:
    """One stack for the module: its tests change nothing the others read (the APIs they start
    beside it have names of their own, their keys are flags of their process, not events)."""
    with running_api_stack(tmp_path_factory.mktemp("edge")) as stack:
        yield stack


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _shape(body: Any, dialect: Dialect) -> str:
    """The message of an error body, after checking its dialect's shape."""
    if dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return str(body["error"])
    if dialect == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return str(body["error"]["message"])
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return str(body["error"]["message"])


@dataclass
class Raw:
    """One request over a plain socket, as a client that sends what it likes: its answer
    (status, headers, parsed body) and how long the answer took after the headers went."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    after_s: float = 0.0
    sent: int = 0  # body bytes the client managed to send


def raw_request(
    port: int,
    head: str,
    body_chunks: Iterator[bytes] | None = None,
    pause_s: float = 0.0,
    timeout: float = 30.0,
) -> Raw:
    """Send ``head`` (request line and headers, CRLF-separated, without the blank line), then
    the body's chunks from a thread of their own (pausing between them; stopping when the
    server closes), while reading the answer until the server closes or ``timeout``."""
    raw = Raw()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head.encode("latin-1") + b"\r\n\r\n")
    started = time.monotonic()
    stop = threading.Event()

    def send_body() -> None:
        for chunk in body_chunks or iter(()):
            if stop.is_set():
                return
            try:
                sock.sendall(chunk)
            except OSError:
                return
            raw.sent += len(chunk)
            if pause_s:
                time.sleep(pause_s)

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or not _whole(answer):
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            if not answer:
                raw.after_s = time.monotonic() - started
            answer += data
    finally:
        stop.set()
        sock.close()
        sender.join(10)
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), answer[:300]
    raw.status = int(lines[0].split()[1])
    raw.headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    # A server that refuses a body still being sent closes on it: the reset may cut its
    # answer's body short (the status and headers came first), so only a whole body is read.
    raw.body = None
    if body and _whole(answer):
        with contextlib.suppress(ValueError):
            raw.body = json.loads(body)
    return raw


def _whole(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _ones(total: int, chunk: int = MiB) -> Iterator[bytes]:
    block = b"x" * chunk
    for _ in range(total // chunk):
        yield block


def _chunked(total: int, chunk: int = MiB) -> Iterator[bytes]:
    """``_ones`` framed as HTTP/1.1 chunks: a body sent unframed under ``Transfer-Encoding:
    chunked`` is a 400 from the parser whenever its bytes arrive before the app's refusal."""
    for block in _ones(total, chunk):
        yield b"%x\r\n" % len(block) + block + b"\r\n"
    yield b"0\r\n\r\n"


def _huge_stream() -> Iterator[bytes]:
    block = b" " * MiB
    for _ in range(HUGE // MiB):
        yield block


def _post_stream(url: str, chunks: Iterator[bytes]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as client:
        return client.post(CHAT, content=chunks, headers={"content-type": "application/json"})


async def _warm(url: str) -> None:
    """A few ordinary requests, so that the process's memory is what it serves with."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(5):
            await client.get("/v1/models")
            big = [{"role": "user", "content": "x" * 100_000}]
            await client.post(CHAT, json={"model": "none", "messages": big})


def _chat_head(port: int, length: int | None, extra: str = "", path: str = CHAT) -> str:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
    return f"{head}\r\n{framing}" + (f"\r\n{extra}" if extra else "")


@pytest.mark.slow
async def test_a_300_mb_body_is_a_413_at_once_and_the_memory_stays_flat(
    api_stack: ApiStack,
) -> None:
    port = _port(api_stack.url)
    await _warm(api_stack.url)
    pid = api_stack.procs.procs["api"].pid
    before = psutil.Process(pid).memory_info().rss
    with PeakRss(pid) as rss:
        # Announced by Content-Length: refused before any of it is read.
        announced = await asyncio.to_thread(raw_request, port, _chat_head(port, HUGE), _ones(HUGE))
        assert announced.status == 413, announced
        assert announced.after_s < 1.0, announced.after_s
        assert announced.headers["connection"] == "close"
        assert f"{HUGE} bytes" in _shape(announced.body, "openai")
        assert announced.body["error"]["code"] == "request_too_large"
        assert announced.sent < HUGE  # the server closed: the client could not send it all

        # Streamed (chunked, from a generator), through an ordinary client: refused as soon
        # as it passes the limit. (A client must read the answer once it cannot write: httpx's
        # synchronous one does, its asynchronous one, on asyncio, drops it and raises.)
        started = time.monotonic()
        streamed = await asyncio.to_thread(_post_stream, api_stack.url, _huge_stream())
        elapsed = time.monotonic() - started
        assert streamed.status_code == 413, streamed.text
        assert elapsed < 10, elapsed  # 32 MiB over loopback, not 300
        assert f"at most {DEFAULT_LIMIT} bytes" in _shape(streamed.json(), "openai")
    grown = (rss.peak - before) / MiB
    # At most the limit read (32 MiB) and its copy; never the 300 MB, nor its JSON parse.
    assert grown < 80, f"the API's memory grew by {grown:.0f} MiB"
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=10) as client:
        assert (await client.get("/healthz")).status_code == 200  # still serving


@pytest.mark.slow
async def test_a_slowloris_body_is_a_408_within_the_timeout(api_stack: ApiStack) -> None:
    url = api_stack.start_api("slow", "--body-timeout", str(TIMEOUT_S))
    await wait_healthy(url)
    port = _port(url)
    trickle = (b" " for _ in range(10_000))
    slow = await asyncio.to_thread(
        raw_request, port, _chat_head(port, 10_000), trickle, pause_s=0.05
    )
    assert slow.status == 408, slow
    assert TIMEOUT_S - 0.2 <= slow.after_s < TIMEOUT_S + 1.5, slow.after_s
    assert slow.headers["connection"] == "close"
    assert slow.body["error"]["code"] == "request_timeout"
    # Chunked, to Ollama's path: the same, in Ollama's shape.
    chunks = (b"1\r\n \r\n" for _ in range(10_000))
    slow = await asyncio.to_thread(
        raw_request, port, _chat_head(port, None, path="/api/chat"), chunks, pause_s=0.05
    )
    assert slow.status == 408 and slow.after_s < TIMEOUT_S + 1.5, slow
    assert "did not arrive within 2 s" in _shape(slow.body, "ollama")
    # A body that comes whole in time is served (here: no such model).
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        body = {"model": "none", "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post(CHAT, json=body)).status_code == 404


@pytest.mark.slow
async def test_an_unauthenticated_huge_post_is_a_401_without_its_body_being_read(
    api_stack: ApiStack,
) -> None:
    url = api_stack.start_api("keyed", "--api-key", KEY)
    await wait_healthy(url)
    port = _port(url)
    # No body is sent at all: an answer that comes means none was waited for.
    cases: list[tuple[str, str, Dialect]] = [
        ("", CHAT, "openai"),
        ("Authorization: Bearer wrong", CHAT, "openai"),
        ("x-api-key: wrong", "/v1/messages", "anthropic"),
        ("Authorization: Bearer café", "/api/chat", "ollama"),  # not ASCII: once a 500
    ]
    for header, path, dialect in cases:
        head = _chat_head(port, HUGE, header.encode().decode("latin-1"), path=path)
        refused = await asyncio.to_thread(raw_request, port, head, None, timeout=10)
        assert refused.status == 401, (header, refused)
        assert refused.after_s < 1.0 and refused.headers["connection"] == "close"
        assert "API key" in _shape(refused.body, dialect)
        assert KEY not in json.dumps(refused.body)
    # With the key, the same request reaches the size limit.
    head = _chat_head(port, HUGE, f"Authorization: Bearer {KEY}")
    too_large = await asyncio.to_thread(raw_request, port, head, None, timeout=10)
    assert too_large.status == 413
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        # The health checks and the dashboard need no key; a non-ASCII key on them is ignored.
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/")).status_code == 200
        sent = {"authorization": "Bearer café".encode()}
        r = await client.get("/v1/models", headers=sent)  # type: ignore[arg-type]
        assert r.status_code == 401
        r = await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200


@pytest.mark.slow
async def test_bodies_on_the_public_paths_are_refused_unread(api_stack: ApiStack) -> None:
    """Once, three unauthenticated 32 MiB POSTs to /health took the node from 189 MB to 3.6 GB
    and made an authorized request wait 26 s: now each is refused before its body is read,
    the memory stays flat, and an authorized request goes on meanwhile."""
    url = api_stack.start_api("public", "--api-key", KEY)
    await wait_healthy(url)
    port = _port(url)
    await _warm(url)
    pid = api_stack.procs.procs["public"].pid
    before = psutil.Process(pid).memory_info().rss
    body = 32 * MiB
    heads = [
        f"POST /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {body}",
        f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {body}",
        f"POST /static/x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nTransfer-Encoding: chunked",
    ]
    with PeakRss(pid) as rss:
        refusing = [
            asyncio.to_thread(
                raw_request,
                port,
                head,
                _chunked(body) if "chunked" in head else _ones(body),
                timeout=10,
            )
            for head in heads
        ]
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            started = time.monotonic()
            models = await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
            authorized_s = time.monotonic() - started
        refused = await asyncio.gather(*refusing)
    assert models.status_code == 200 and authorized_s < 2.0, authorized_s
    assert [r.status for r in refused] == [405, 413, 405], refused
    assert all(r.after_s < 1.0 and r.headers["connection"] == "close" for r in refused), refused
    grown = (rss.peak - before) / MiB
    assert grown < 16, f"the API's memory grew by {grown:.0f} MiB"


@pytest.mark.slow
async def test_hosts_origins_and_content_types(api_stack: ApiStack) -> None:
    url = api_stack.start_api(
        "browsers", "--allowed-host", "shoal.example", "--cors-origin", "https://app.example"
    )
    await wait_healthy(url)
    port = _port(url)
    body = {"model": "none", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        # DNS rebinding: a name the API does not know is refused; a name it was given is not.
        r = await client.get("/v1/models", headers={"host": f"evil.example:{port}"})
        assert r.status_code == 400
        assert "--allowed-host evil.example" in _shape(r.json(), "openai")
        r = await client.get("/api/tags", headers={"host": f"rebound.example:{port}"})
        assert r.status_code == 400 and "rebound.example" in _shape(r.json(), "ollama")
        for host in (f"shoal.example:{port}", f"localhost:{port}", f"[::1]:{port}"):
            assert (await client.get("/v1/models", headers={"host": host})).status_code == 200

        # A page of another origin is refused, whatever it asks; its own origin and the CORS
        # origin are not; nor is a client without an Origin.
        evil = {"origin": "https://evil.example"}
        r = await client.post(CHAT, json=body, headers=evil)
        assert r.status_code == 403 and "--cors-origin" in _shape(r.json(), "openai")
        r = await client.get("/v1/state", headers=evil)
        assert r.status_code == 403
        r = await client.post("/v1/messages", json=body | {"max_tokens": 5}, headers=evil)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        for origin in ({"origin": f"http://127.0.0.1:{port}"}, {"origin": "https://app.example"}):
            assert (await client.post(CHAT, json=body, headers=origin)).status_code == 404
        assert (await client.post(CHAT, json=body)).status_code == 404  # no such model

        # A body must say it is JSON: a form's (what a page may send without a preflight) is
        # a 415 in each dialect.
        form = {"content-type": "application/x-www-form-urlencoded"}
        for path, dialect in (
            (CHAT, "openai"),
            ("/v1/messages", "anthropic"),
            ("/api/chat", "ollama"),
        ):
            r = await client.post(path, content=json.dumps(body), headers=form)
            assert r.status_code == 415, r.text
            assert "application/json" in _shape(r.json(), dialect)  # type: ignore[arg-type]
        r = await client.post(CHAT, content=json.dumps(body))  # no Content-Type at all
        assert r.status_code == 415
        # Bodyless requests need none (a cancel, Ollama's GETs).
        assert (await client.get("/api/tags")).status_code == 200
        assert (await client.post("/v1/responses/resp_nope/cancel")).status_code == 404


@pytest.mark.slow
async def test_a_lone_surrogate_is_a_400_not_a_500(api_stack: ApiStack) -> None:
    raw = '{"model": "none", "messages": [{"role": "user", "content": "\\ud800"}]}'
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=10) as client:
        json_type = {"content-type": "application/json"}
        r = await client.post(CHAT, content=raw, headers=json_type)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages.0.content"
        r = await client.post("/api/chat", content=raw, headers=json_type)
        assert r.status_code == 400 and "messages.0.content" in _shape(r.json(), "ollama")
        embed = '{"model": "none", "input": ["ok", "\\udfff"]}'
        r = await client.post("/v1/embeddings", content=embed, headers=json_type)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input.1"
        # An emoji escaped as a pair is text: past the check (no such model).
        pair = raw.replace("\\ud800", "\\ud83d\\ude00")
        assert (await client.post(CHAT, content=pair, headers=json_type)).status_code == 404


@pytest.mark.slow
async def test_headers_too_large_are_a_431(api_stack: ApiStack) -> None:
    port = _port(api_stack.url)
    head = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Big: " + "a" * 200_000
    answer = await asyncio.to_thread(raw_request, port, head, None, timeout=10)
    assert answer.status == 431 and answer.headers["connection"] == "close"
    assert answer.body["error"]["code"] == "headers_too_large"
    async with httpx.AsyncClient(base_url=api_stack.url, timeout=10) as client:
        cookies = {"cookie": "; ".join(f"c{i}={'v' * 40}" for i in range(200))}  # ~9 KB
        assert (await client.get("/v1/models", headers=cookies)).status_code == 200


def _lan_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


@pytest.mark.slow
async def test_on_every_address_the_machine_s_own_names_and_addresses_are_answered(
    api_stack: ApiStack,
) -> None:
    lan = _lan_address()
    if lan is None:
        pytest.skip("this machine has no address beyond loopback")
    port = free_port("0.0.0.0")
    api_stack.procs.start(
        "everywhere", "api", "--nats", api_stack.nats_url, "--db", api_stack.db_url,
        "--host", "0.0.0.0", "--port", str(port), "--api-key", KEY,
    )  # fmt: skip
    url = f"http://{lan}:{port}"
    await wait_healthy(url)
    hostname = socket.gethostname()
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        client.headers["authorization"] = f"Bearer {KEY}"
        assert (await client.get("/v1/models")).status_code == 200  # Host: the LAN address
        for host in (hostname, f"{hostname.split('.')[0]}.local", "localhost"):
            r = await client.get("/v1/models", headers={"host": f"{host}:{port}"})
            assert r.status_code == 200, (host, r.text)
        r = await client.get("/v1/models", headers={"host": f"evil.example:{port}"})
        assert r.status_code == 400
        assert lan not in r.text and hostname not in r.text  # the machine's names not shown


def test_shoal_api_refuses_to_listen_beyond_loopback_without_keys() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_API")}
    done = subprocess.run(
        [SHOAL, "api", "--host", "0.0.0.0", "--port", str(free_port("127.0.0.1"))],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean,
    )
    assert done.returncode == 1
    assert "refusing to listen on 0.0.0.0 without API keys" in done.stderr, done.stderr
    assert "NATS" not in done.stderr  # `shoal api` runs no NATS server
    bad = subprocess.run(
        [SHOAL, "api", "--max-body", "0"], capture_output=True, text=True, timeout=60, env=clean
    )
    assert bad.returncode == 2 and "--max-body" in bad.stderr
