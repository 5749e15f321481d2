"""Images fetched by URL (api/images/fetching.py): the guard against server-side request
forgery refuses what is not a public address, before connecting; the client itself is tried on
a real server on loopback, which the test alone allows."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
from collections.abc import AsyncIterator
from typing import Any

import pytest

from api.errors import ApiError
from api.images.fetching import IpAddress, fetch_image, public_address
from api.images.inputs import ImageInput
from api.images.loading import ImagePolicy, read_images
from events.images import MAX_IMAGES, decode_refusal
from events.records import ImagePart, PartRef
from harness.images import png


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # shared address space (carrier NAT)
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("2002:7f00:1::1", False),  # 6to4 of 127.0.0.1
        ("ff02::1", False),
        ("8.8.8.8", True),
        ("93.184.216.34", True),
        ("2606:4700:4700::1111", True),
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
    ],
)
def test_only_public_addresses_pass(address: str, public: bool) -> None:
    assert public_address(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a.png",
        "http://10.1.2.3/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:8000/a.png",
        "https://[::ffff:127.0.0.1]/a.png",
        "http://localhost:8000/a.png",  # a name that resolves to loopback
        "http://0.0.0.0/a.png",
    ],
)
async def test_a_private_address_is_refused_before_connecting(url: str) -> None:
    with pytest.raises(ApiError) as caught:
        await fetch_image(ImageInput(url=url, where="messages.0.content.0"), 1000)
    assert caught.value.status == 400
    assert "not a public address" in caught.value.message
    assert caught.value.param == "messages.0.content.0"


def _loopback(ip: IpAddress) -> bool:
    return ip.is_loopback


IMAGE = png(5, 5)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    path = head.split(" ")[1].partition("?")[0]
    answers = {
        "/a.png": b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(IMAGE) + IMAGE,
        "/no-length.png": b"HTTP/1.0 200 OK\r\n\r\n" + IMAGE,
        "/big.png": b"HTTP/1.0 200 OK\r\nContent-Length: 999999\r\n\r\n",
        "/endless.png": b"HTTP/1.0 200 OK\r\n\r\n" + b"\x00" * 5000,
        "/moved": b"HTTP/1.0 302 Found\r\nLocation: /a.png\r\n\r\n",
        "/to-private": b"HTTP/1.0 301 Moved\r\nLocation: http://10.1.2.3/a.png\r\n\r\n",
        "/loop": b"HTTP/1.0 307 Again\r\nLocation: /loop\r\n\r\n",
        "/host": f"HTTP/1.0 200 OK\r\n\r\n{head}".encode(),
    }
    if path == "/slow.png":
        await asyncio.sleep(5)
    writer.write(answers.get(path, b"HTTP/1.0 404 Not Found\r\n\r\n"))
    await writer.drain()
    writer.close()


@pytest.fixture
async def server() -> AsyncIterator[str]:
    listening = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    async with listening:
        yield f"http://127.0.0.1:{port}"


async def _fetched(url: str, max_bytes: int = 4096, timeout_s: float = 5.0) -> bytes:
    given = ImageInput(url=url, where="input.0.content.0")
    return await fetch_image(given, max_bytes, allowed=_loopback, timeout_s=timeout_s)


async def test_an_image_is_fetched_and_redirects_followed(server: str) -> None:
    assert await _fetched(f"{server}/a.png") == IMAGE
    assert await _fetched(f"{server}/no-length.png") == IMAGE
    assert await _fetched(f"{server}/moved") == IMAGE
    asked = (await _fetched(f"{server}/host?x=1")).decode()
    assert asked.startswith("GET /host?x=1 HTTP/1.0\r\n")
    assert f"Host: {server.removeprefix('http://')}\r\n" in asked


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/big.png", 413, "999999 bytes, more than the 4096 bytes"),
        ("/endless.png", 413, "more than the 4096 bytes"),
        ("/missing.png", 400, "answered 404"),
        ("/to-private", 400, "10.1.2.3, not a public address"),
        ("/loop", 400, "redirects more than 3 times"),
        ("/slow.png", 400, "within 0.5 s"),
    ],
)
async def test_what_cannot_be_fetched_is_said(
    server: str, path: str, status: int, says: str
) -> None:
    with pytest.raises(ApiError) as caught:
        await _fetched(f"{server}{path}", timeout_s=0.5)
    assert caught.value.status == status and says in caught.value.message
    assert caught.value.message.startswith("input.0.content.0: ")


async def test_a_host_that_cannot_be_reached_is_a_400() -> None:
    with pytest.raises(ApiError, match=r"could not be reached|not known"):
        await _fetched("http://127.0.0.1:1/a.png")
    with pytest.raises(ApiError, match="not known"):
        await _fetched("http://no-such-host.invalid/a.png")


# --- what one request's images may be in all (api/images/loading.py) ------------------------


def _policy(**given: Any) -> ImagePolicy:
    return ImagePolicy(accepts=True, allow_urls=True, allowed=_loopback, **given)


def _data(image: bytes, where: str) -> ImageInput:
    return ImageInput(base64=base64.b64encode(image).decode(), where=where)


async def test_an_image_bomb_is_a_413_before_anything_is_decoded_or_queued() -> None:
    """Once, 40 copies of a 65 KB 8192x8192 PNG (3.5 MB of request) asked a runner to decode
    7.5 GiB, and killed it and each runner the task was resumed on."""
    bomb = png(8192, 8192)
    copies = [_data(bomb, f"messages.0.content.{i}") for i in range(2)]
    with pytest.raises(ApiError) as caught:
        await read_images(copies, "m", _policy())
    assert caught.value.status == 413 and "pixels in all" in caught.value.message
    assert caught.value.param == "messages.0.content.1"  # the one past the budget
    many = [_data(png(2, 2), f"messages.0.content.{i}") for i in range(MAX_IMAGES + 1)]
    with pytest.raises(ApiError) as caught:
        await read_images(many, "m", _policy())
    assert caught.value.status == 413 and f"more than the {MAX_IMAGES}" in caught.value.message
    assert len((await read_images(many[:MAX_IMAGES], "m", _policy())).records) == 1


async def test_image_urls_are_bounded_and_fetched_only_once_the_request_would_pass(
    server: str,
) -> None:
    urls = [ImageInput(url=f"{server}/a.png?{i}", where=f"m.{i}") for i in range(9)]
    with pytest.raises(ApiError) as caught:
        await read_images(urls, "m", _policy())
    assert caught.value.status == 413 and "9 image URLs, more than the 8" in caught.value.message
    asked: list[str] = []

    async def refusing() -> None:
        asked.append("checked")
        raise ApiError(429, "over the key's limit")

    with pytest.raises(ApiError) as caught:  # nothing fetched for a request refused anyway
        await read_images(urls[:2], "m", _policy(), refusing)
    assert caught.value.status == 429 and asked == ["checked"]
    with pytest.raises(ApiError) as caught:  # 55 bytes an image, 100 in all
        await read_images(urls[:2], "m", _policy(max_fetched=100))
    assert caught.value.status == 413 and "100 bytes in all" in caught.value.message
    assert len((await read_images(urls[:2], "m", _policy(max_fetched=200))).records) == 2


def test_a_runner_checks_the_images_pixels_before_decoding_them() -> None:
    part = ImagePart(
        sha256="a" * 64,
        media_type="image/png",
        width=8192,
        height=8192,
        bytes=65_000,
        ref=PartRef(digest="b" * 64, parts=1, bytes=1),
    )
    assert decode_refusal([part]) is None
    assert "pixels in all" in str(decode_refusal([part, part]))
    small = part.model_copy(update={"width": 2, "height": 2})
    assert "17 images" in str(decode_refusal([small] * 17))
