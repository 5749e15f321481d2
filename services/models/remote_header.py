"""A GGUF model's numbers before it is downloaded: its header read over HTTP range requests.

The header (architecture, layers, heads, context, vocabulary, tensor list) is at the start of
the file: the first megabyte or so, a few more for a large vocabulary. It is fetched in growing
ranges until it parses, never the tensors. The size of each file, and of every part of a split
one, comes from the ``Content-Range`` of those responses. With it, placement's estimate is the
model's own rather than its card's.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from modelfiles.gguf_header import GgufTruncated, parse_gguf_header
from modelfiles.shard_files import split_parts
from services.models.cards import CardEstimate, HfSource, ModelCard
from services.models.metadata import GgufInfo, gguf_facts, info_from_header

FIRST_BYTES = 1024 * 1024
# No header is this long (Gemma 3's 262,144-token vocabulary takes about 5 MiB).
MAX_HEADER_BYTES = 64 * 1024 * 1024


class RemoteHeaderError(RuntimeError):
    """The header could not be read over HTTP; the message says why."""


@dataclass(frozen=True)
class RemoteGguf:
    info: GgufInfo  # size_bytes: every part's
    fetched_bytes: int  # what was downloaded to read it


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Follows redirects (the Hub sends downloads to its CDN) without taking a token along to
    another host."""

    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlsplit(newurl).hostname != urlsplit(req.full_url).hostname:
            new.remove_header("Authorization")
        return new


def _get_range(
    url: str, start: int, end: int, token: str | None, timeout: float
) -> tuple[bytes, int]:
    """Bytes ``start..end`` (inclusive) of ``url`` and the file's whole size."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end}"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_SameHostAuth)
    try:
        with opener.open(request, timeout=timeout) as response:
            total = response.headers.get("Content-Range", "").rpartition("/")[2]
            if response.status != 206 or not total.isdigit():
                # A server that ignores ranges sends the whole file: not read for a header.
                raise RemoteHeaderError(f"{url}: the server does not answer range requests")
            data: bytes = response.read()
            return data, int(total)
    except urllib.error.HTTPError as exc:
        raise RemoteHeaderError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise RemoteHeaderError(f"{url}: {getattr(exc, 'reason', exc)}") from exc


def read_remote_gguf(
    url: str,
    *,
    token: str | None = None,
    first_bytes: int = FIRST_BYTES,
    timeout: float = 30.0,
) -> RemoteGguf:
    """The GGUF header at ``url`` (a split model's first part: the others, named as llama.cpp
    names them beside it, only have their sizes asked)."""
    want = first_bytes
    fetched = 0
    while True:
        data, total = _get_range(url, 0, want - 1, token, timeout)
        fetched += len(data)
        try:
            kv, tensor_types = parse_gguf_header(data, url)
            break
        except GgufTruncated:
            if len(data) >= total or want >= MAX_HEADER_BYTES:
                raise RemoteHeaderError(
                    f"{url}: no complete GGUF header in its first {len(data)} bytes"
                ) from None
            want *= 4
    size = total
    folder, _, name = url.rpartition("/")
    for part in split_parts(name)[1:]:
        _, part_size = _get_range(f"{folder}/{part}", 0, 0, token, timeout)
        fetched += 1
        size += part_size
    return RemoteGguf(info_from_header(name, kv, tensor_types, size), fetched)


def hub_url(
    repo: str, filename: str, revision: str | None = None, endpoint: str | None = None
) -> str:
    """Where the Hub (``endpoint``: another than HF_ENDPOINT) serves a repository's file."""
    from huggingface_hub import hf_hub_url

    return str(hf_hub_url(repo, filename, revision=revision, endpoint=endpoint))


def hub_estimate(
    card: ModelCard, token: str | None = None, endpoint: str | None = None
) -> CardEstimate:
    """A GGUF card's numbers from its file's header on the Hub (``RemoteHeaderError`` when it
    cannot be read), in place of the card's own estimate."""
    source = card.source
    if not isinstance(source, HfSource) or source.filename is None:
        raise RemoteHeaderError(f"{card.id}: not a GGUF file on the Hugging Face Hub")
    url = hub_url(source.repo, source.filename, source.revision, endpoint)
    remote = read_remote_gguf(url, token=token)
    facts = gguf_facts(remote.info)
    return CardEstimate(
        n_layers=facts.n_layers,
        context_length=facts.context_length,
        size_bytes=facts.size_bytes,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        overhead_bytes=facts.overhead_bytes,
        # The weights' header says nothing of the projector beside them: the card's figure.
        projector_bytes=card.estimate.projector_bytes if card.estimate is not None else 0,
    )
