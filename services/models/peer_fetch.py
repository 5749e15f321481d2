"""A weight file taken from another node's weights server (``services/worker/weights_server``)
over plain HTTP, as ``curl`` would, but resumed and checked as a fetch from the bucket is.

It writes to the same partial file as a fetch from the bucket (any prefix of it is the file's
own bytes, whoever wrote it), resumes from its length with a ``Range`` request, hashes while
it writes (in a second thread, so that hashing, the slowest part, overlaps the socket) and
renames the file into place only once its SHA-256 is the one asked for.
"""

from __future__ import annotations

import hashlib
import http.client
import re
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from bus.stores.object_fetch import hash_prefix, partial_paths
from bus.stores.object_store import DigestMismatch
from events.catalogue import WeightFile
from services.models.weight_offers import WeightsOffer

BLOCK_BYTES = 4 * 1024 * 1024
# Blocks read but not hashed yet: the fetch's memory, whatever the file's size.
BUFFERS = 4
# A server that sends nothing for this long is given up on (the fetch resumes when asked again).
STALLED_S = 30.0

_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class PeerFetchError(RuntimeError):
    """The node that offered the file could not give it; the message says what it answered."""


def blob_path(sha256: str) -> str:
    """The path of a blob on a weights server."""
    return f"/blobs/{sha256}"


def fetch_from_peer(
    offer: WeightsOffer,
    f: WeightFile,
    target: Path,
    on_progress: Callable[[int], None] | None = None,
) -> None:
    """Fetch ``f`` from the node of ``offer`` into ``target`` (blocking: run it in a thread).
    ``on_progress`` gets the bytes written so far, resumed ones included."""
    partial, _ = partial_paths(target)
    offset = partial.stat().st_size if partial.exists() else 0
    if offset > f.size:
        offset = 0
    url = urlsplit(offer.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=STALLED_S)
    try:
        conn.request(
            "GET",
            url.path.rstrip("/") + blob_path(f.sha256),
            headers={
                "Authorization": f"Bearer {offer.ticket}",
                "Range": f"bytes={offset}-",
            },
        )
        response = conn.getresponse()
        if response.status == 200:
            offset = 0  # the whole file: the server ignored the range
        elif response.status != 206 or _range_start(response) != offset:
            body = response.read(300).decode(errors="replace")
            raise PeerFetchError(
                f"{f.name}: node {offer.node_id} answered {response.status} {response.reason}"
                + (f": {body}" if body else "")
            )
        sha = hash_prefix(partial, offset) if offset else hashlib.sha256()
        _receive(response, partial, offset, f.size, sha, on_progress)
    except (OSError, http.client.HTTPException) as exc:
        raise PeerFetchError(f"{f.name}: from node {offer.node_id}: {exc}") from exc
    finally:
        conn.close()
    if sha.hexdigest() != f.sha256:
        partial.unlink(missing_ok=True)
        raise DigestMismatch(
            f"{f.name}: the bytes node {offer.node_id} sent do not have the digest the model"
            " names; the partial file was removed"
        )
    partial.replace(target)


def _range_start(response: http.client.HTTPResponse) -> int | None:
    match = _RANGE.match(response.getheader("Content-Range") or "")
    return int(match.group(1)) if match else None


def _receive(
    response: http.client.HTTPResponse,
    partial: Path,
    offset: int,
    size: int,
    sha: hashlib._Hash,
    on_progress: Callable[[int], None] | None,
) -> None:
    """Read the body into ``partial`` from ``offset``, hashing each block in a thread of its
    own while the next one is read (the hasher takes the blocks in order)."""
    buffers = [bytearray(BLOCK_BYTES) for _ in range(BUFFERS)]
    hashing: deque[Future[None]] = deque()
    done = offset
    with (
        # Appended to: ``offset`` is the partial file's length, or 0 and the file is new.
        partial.open("ab" if offset else "wb", buffering=0) as out,
        ThreadPoolExecutor(1) as hasher,
    ):
        i = 0
        while done < size:
            if len(hashing) == BUFFERS:
                hashing.popleft().result()  # the buffer about to be reused is hashed
            view = memoryview(buffers[i % BUFFERS])[: min(BLOCK_BYTES, size - done)]
            i += 1
            n = response.readinto(view)
            if n == 0:
                raise PeerFetchError(f"the body ended at {done} of {size} bytes")
            out.write(view[:n])
            hashing.append(hasher.submit(sha.update, view[:n]))
            done += n
            if on_progress is not None:
                on_progress(done)
        for pending in hashing:
            pending.result()
