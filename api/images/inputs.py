"""An image as a request gives it, in any dialect, before it is read: one shape for all.

- OpenAI's chat ``image_url`` part and the Responses API's ``input_image``: a URL, either a
  ``data:`` URL (base64) or ``http(s)``, fetched only where the operator allows it;
- Anthropic's ``image`` block: a ``base64`` source or a ``url`` source;
- Ollama's ``images``: base64 strings (a data URL too, as some clients send).

Each dialect's translation makes an ``ImageInput`` of what it was sent (a ``ValueError`` for a
malformed one, which the dialect's validation turns into a 400 naming the field), and later
reads the stored image back by the input (``api/images/loading.py``). Pure.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field

from api.errors import ApiError
from events.units import MiB

# data:[<media type>][;<parameter>...][;base64],<data>
_DATA_URL = re.compile(r"^data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.IGNORECASE)
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class ImageInput:
    """An image as sent: its bytes in base64, or an http(s) URL to fetch. ``where``: the
    request's field it was sent in (``messages.0.content.1``, as validation errors name
    fields), for errors about it."""

    base64: str | None = None
    url: str | None = None
    where: str = field(default="", compare=False)

    @property
    def key(self) -> str:
        """What tells this image from others of the request (the same text: the same image)."""
        if self.base64 is not None:
            return self.base64
        assert self.url is not None
        return self.url


def image_url(url: str, where: str = "") -> ImageInput:
    """An image given by URL: a ``data:`` URL's base64, or an http(s) URL (``ValueError``
    for anything else)."""
    if url[:5].lower() == "data:":
        match = _DATA_URL.match(url)
        if match is None:
            raise ValueError("the image's data URL is malformed: send data:image/png;base64,...")
        if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
            raise ValueError("the image's data URL is not base64: send data:image/png;base64,...")
        return ImageInput(base64=url[match.end() :], where=where)
    scheme = url.partition(":")[0].lower()
    if scheme not in ("http", "https"):
        raise ValueError(
            "an image URL is a data URL (data:image/png;base64,...) or an http(s) URL,"
            f" not {url[:40]!r}"
        )
    return ImageInput(url=url, where=where)


def image_base64(data: str, where: str = "") -> ImageInput:
    """An image given as base64 (Anthropic's and Ollama's); a data URL is taken too."""
    if data[:5].lower() == "data:":
        return image_url(data, where)
    return ImageInput(base64=data, where=where)


def refused(status: int, problem: str, given: ImageInput) -> ApiError:
    """The 400 or 413 of an image, naming where it was sent."""
    where = given.where or "the image"
    code = "image_too_large" if status == 413 else "invalid_image"
    return ApiError(status, f"{where}: {problem}", param=given.where or None, code=code)


def decoded(given: ImageInput, max_bytes: int) -> bytes:
    """The bytes of an image sent as base64: a 413 when they would be more than
    ``max_bytes`` (found before decoding), a 400 when it is not base64 or is empty."""
    assert given.base64 is not None
    text = given.base64
    # Before decoding: 4 characters are 3 bytes (the slack: base64 broken into lines).
    if (about := len(text) * 3 // 4) > max_bytes + max_bytes // 16:
        raise refused(413, _too_large(about, max_bytes), given)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        try:  # base64 broken into lines (MIME's), or with spaces
            data = base64.b64decode(_WHITESPACE.sub("", text), validate=True)
        except (binascii.Error, ValueError):
            raise refused(400, "the image is not valid base64", given) from None
    if not data:
        raise refused(400, "the image is empty", given)
    if len(data) > max_bytes:
        raise refused(413, _too_large(len(data), max_bytes), given)
    return data


def _too_large(size: int, max_bytes: int) -> str:
    return (
        f"the image is {size} bytes, more than the {max_bytes} bytes ({max_bytes / MiB:g} MiB)"
        " an image may be here"
    )
