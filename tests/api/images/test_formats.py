"""What an image is, read from its bytes' header (api/images/formats.py), and an image as a
request sends it, decoded (api/images/inputs.py): pure."""

from __future__ import annotations

import pytest

from api.errors import ApiError
from api.images.formats import ImageInfo, UnreadableImage, read_header
from api.images.inputs import ImageInput, decoded, image_base64, image_url
from harness.images import b64, data_url, gif, jpeg, png, webp_extended, webp_lossless, webp_lossy


@pytest.mark.parametrize(
    ("data", "info"),
    [
        (png(2, 3), ImageInfo("image/png", 2, 3)),
        (png(1, 1, pad=100_000), ImageInfo("image/png", 1, 1)),
        (jpeg(640, 480), ImageInfo("image/jpeg", 640, 480)),
        (gif(4, 5), ImageInfo("image/gif", 4, 5)),
        (webp_lossy(6, 7), ImageInfo("image/webp", 6, 7)),
        (webp_lossless(300, 200), ImageInfo("image/webp", 300, 200)),
        (webp_extended(600, 700), ImageInfo("image/webp", 600, 700)),
    ],
)
def test_the_format_and_size_come_from_the_bytes(data: bytes, info: ImageInfo) -> None:
    assert read_header(data) == info


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not a PNG, JPEG, WebP or GIF"),
        (b"BM\x00\x00 a bitmap", "not a PNG, JPEG, WebP or GIF"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "not a PNG"),
        (b"\x89PNG\r\n\x1a\n", "no header"),
        (png()[:40], "cut short"),
        (png()[:-6], "cut short"),
        (png()[:20] + b"\xff" + png()[21:], "checksum"),
        (png(0, 3), "0x3 pixels"),
        (jpeg()[:8], "no frame header"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF" + b"\x00" * 30, "damaged"),
        (gif()[:8], "cut short"),
        (webp_lossy()[:22], "cut short"),
        (webp_lossless().replace(b"\x2f", b"\x00", 1), "signature"),
    ],
)
def test_what_is_no_image_of_an_accepted_format_is_said(data: bytes, says: str) -> None:
    with pytest.raises(UnreadableImage, match=says):
        read_header(data)


def test_data_urls_and_base64_are_read_and_other_urls_refused() -> None:
    assert image_url(data_url(png())) == ImageInput(base64=b64(png()))
    assert image_url("DATA:image/png;charset=x;BASE64," + b64(gif())).base64 == b64(gif())
    assert image_url("https://example.com/a.png") == ImageInput(url="https://example.com/a.png")
    assert image_base64(b64(png())) == ImageInput(base64=b64(png()))
    assert image_base64(data_url(png())) == ImageInput(base64=b64(png()))
    for url, says in [
        ("data:image/png,%89PNG", "not base64"),
        ("data:image/png;base64", "malformed"),
        ("file:///etc/passwd", "or an http"),
        ("ftp://example.com/a.png", "or an http"),
    ]:
        with pytest.raises(ValueError, match=says):
            image_url(url)


def test_base64_is_decoded_within_the_limit() -> None:
    given = ImageInput(base64=b64(png()), where="messages.0.content.1")
    assert decoded(given, 1000) == png()
    lines = ImageInput(base64="\n".join(b64(png())[i : i + 8] for i in range(0, 80, 8)))
    assert decoded(lines, 1000)[:8] == png()[:8]  # MIME's lines are taken too
    for text, limit, status, says in [
        ("not base64!", 1000, 400, "not valid base64"),
        ("", 1000, 400, "empty"),
        (b64(png()), 10, 413, "more than the 10 bytes"),
        ("A" * 4_000_000, 1000, 413, "more than the 1000 bytes"),  # refused before decoding
    ]:
        with pytest.raises(ApiError) as caught:
            decoded(ImageInput(base64=text, where="messages.0.content.1"), limit)
        assert caught.value.status == status and says in caught.value.message
        assert caught.value.param == "messages.0.content.1"
        assert caught.value.message.startswith("messages.0.content.1: ")
