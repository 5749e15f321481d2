"""What an image is, read from its bytes (never from what a client says it is): PNG, JPEG,
WebP or GIF, and its size in pixels from its header. Pure, and cheap: headers only, nothing is
decoded (Shoal has no image library; the engine decodes the pixels).

A PNG's chunks are walked to its ``IEND`` (their lengths only), so that a PNG cut short is
found here; a JPEG's segments up to its frame header; a GIF's logical screen; a WebP's first
chunk (``VP8 ``, ``VP8L`` or ``VP8X``).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from events.records import ImageMediaType

# The most pixels an image may have (8192 x 8192): a few bytes of PNG may say a billion, which
# the engine would then allocate.
MAX_PIXELS = 8192 * 8192

_PNG = b"\x89PNG\r\n\x1a\n"
# JPEG's start-of-frame markers: every one but DHT (C4), JPG (C8) and DAC (CC).
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
# Markers with no length after them: TEM, RST0-7, SOI (and EOI, which ends the search).
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})
FORMATS = "PNG, JPEG, WebP or GIF"


class UnreadableImage(ValueError):
    """Bytes that are not an image of an accepted format, or one whose header is damaged."""


@dataclass(frozen=True)
class ImageInfo:
    media_type: ImageMediaType
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def read_header(data: bytes) -> ImageInfo:
    """The format and size of image ``data``; ``UnreadableImage`` saying why not."""
    if data.startswith(_PNG):
        info = _png(data)
    elif data.startswith(b"\xff\xd8\xff"):
        info = _jpeg(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        info = _gif(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        info = _webp(data)
    else:
        raise UnreadableImage(f"it is not a {FORMATS} image (its first bytes are no such image's)")
    if info.width < 1 or info.height < 1:
        name = info.media_type.removeprefix("image/").upper()
        raise UnreadableImage(f"the {name} says it is {info.width}x{info.height} pixels")
    return info


def _png(data: bytes) -> ImageInfo:
    if len(data) < 33 or data[12:16] != b"IHDR" or data[8:12] != b"\x00\x00\x00\x0d":
        raise UnreadableImage("the PNG has no header (IHDR) where it should be")
    if struct.unpack(">I", data[29:33])[0] != zlib.crc32(data[12:29]):
        raise UnreadableImage("the PNG's header (IHDR) is damaged: its checksum is wrong")
    width, height = struct.unpack(">II", data[16:24])
    at = 8
    while True:  # the chunks' lengths lead from one to the next, up to IEND
        if at + 12 > len(data):
            raise UnreadableImage("the PNG is cut short: it ends before its IEND chunk")
        length = struct.unpack(">I", data[at : at + 4])[0]
        kind = data[at + 4 : at + 8]
        at += 12 + length
        if kind == b"IEND":
            break
    if at > len(data):
        raise UnreadableImage("the PNG is cut short: its IEND chunk is not whole")
    return ImageInfo("image/png", width, height)


def _jpeg(data: bytes) -> ImageInfo:
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            raise UnreadableImage(f"the JPEG is damaged: no segment marker at byte {at}")
        marker = data[at + 1]
        if marker == 0xFF:  # fill bytes before a marker
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        if marker in (0xD9, 0xDA):  # the image's end, or its scan, before any frame header
            break
        length = struct.unpack(">H", data[at + 2 : at + 4])[0]
        if length < 2:
            raise UnreadableImage(f"the JPEG is damaged: a segment of length {length}")
        if marker in _SOF:
            if at + 9 > len(data) or length < 7:
                break
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return ImageInfo("image/jpeg", width, height)
        at += 2 + length
    raise UnreadableImage("the JPEG is cut short or damaged: it has no frame header (SOF)")


def _gif(data: bytes) -> ImageInfo:
    if len(data) < 13:
        raise UnreadableImage("the GIF is cut short: it has no logical screen descriptor")
    width, height = struct.unpack("<HH", data[6:10])
    return ImageInfo("image/gif", width, height)


def _webp(data: bytes) -> ImageInfo:
    kind, body = data[12:16], data[20:]
    if kind == b"VP8 " and len(body) >= 10:
        if body[3:6] != b"\x9d\x01\x2a":
            raise UnreadableImage("the WebP (VP8) is damaged: its frame has no start code")
        width, height = struct.unpack("<HH", body[6:10])
        return ImageInfo("image/webp", width & 0x3FFF, height & 0x3FFF)
    if kind == b"VP8L" and len(body) >= 5:
        if body[0] != 0x2F:
            raise UnreadableImage("the WebP (VP8L) is damaged: its signature is wrong")
        bits = int.from_bytes(body[1:5], "little")
        return ImageInfo("image/webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if kind == b"VP8X" and len(body) >= 10:
        width = int.from_bytes(body[4:7], "little") + 1
        height = int.from_bytes(body[7:10], "little") + 1
        return ImageInfo("image/webp", width, height)
    raise UnreadableImage("the WebP is cut short or damaged: no VP8, VP8L or VP8X chunk header")
