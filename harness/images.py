"""Small images made byte by byte, for the tests of images in requests (no image library)."""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable

from bus.stores.images import stored_image
from events.catalogue import TaskCreated
from events.records import ChatMessage, SamplingParams


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int = 2, height: int = 2, pad: int = 0, colour: int = 0) -> bytes:
    """A valid RGB PNG of one colour; ``pad``: the bytes of an ancillary chunk that decoders
    skip, to make it as large as a test needs."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = b"\x00" + bytes([colour, 255 - colour, 128]) * width
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
    if pad:
        out += _chunk(b"shLo", b"\x00" * pad)
    return out + _chunk(b"IDAT", zlib.compress(row * height)) + _chunk(b"IEND", b"")


def drawn_png(width: int, height: int, pixel: Callable[[int, int], tuple[int, int, int]]) -> bytes:
    """A valid RGB PNG whose pixel at (x, y) is ``pixel(x, y)``."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = b"".join(
        b"\x00" + b"".join(bytes(pixel(x, y)) for x in range(width)) for y in range(height)
    )
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


def gradient_png(width: int = 48, height: int = 40) -> bytes:
    return drawn_png(width, height, lambda x, y: (x * 5 % 256, y * 6 % 256, 128))


def checkers_png(width: int = 48, height: int = 40) -> bytes:
    return drawn_png(width, height, lambda x, y: (255,) * 3 if (x // 8 + y // 8) % 2 else (0,) * 3)


def jpeg(width: int = 3, height: int = 2) -> bytes:
    """A JPEG's header (an APP0 segment, then a baseline frame header), then its end."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def gif(width: int = 4, height: int = 5) -> bytes:
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b";"


def webp_lossy(width: int = 6, height: int = 7) -> bytes:
    frame = b"\x00\x00\x00\x9d\x01\x2a" + struct.pack("<HH", width, height)
    return _riff(b"VP8 ", frame)


def webp_lossless(width: int = 6, height: int = 7) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    return _riff(b"VP8L", b"\x2f" + bits.to_bytes(4, "little"))


def webp_extended(width: int = 600, height: int = 700) -> bytes:
    body = b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little")
    return _riff(b"VP8X", body + (height - 1).to_bytes(3, "little"))


def _riff(kind: bytes, body: bytes) -> bytes:
    chunk = kind + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def image_chat(
    data: bytes | None, text: str, at: int = 0, max_tokens: int = 8
) -> tuple[TaskCreated, dict[str, bytes]]:
    """A one-message chat task, its image (if any) at ``at`` in its text, and the image's bytes
    by digest: what a runner's engine tests prepare."""
    images, read = [], {}
    if data is not None:
        image, _ = stored_image(data, "image/png", 48, 40)
        images, read = [image.model_copy(update={"at": at})], {image.sha256: data}
    message = ChatMessage(role="user", content=text, images=images)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    task = TaskCreated(
        task_id="t", model_id="m", origin="test", kind="chat", messages=[message], params=params
    )
    return task, read
