"""A GGUF model's numbers read over HTTP range requests before any download: the header only
(a few megabytes of a large file), every part's size for a split model, the token kept from
other hosts, and what a server without ranges gets."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from harness.models.split_gguf import split_gguf
from services.models.cards import HfSource, ModelCard
from services.models.catalogue import card_for
from services.models.metadata import model_facts, read_gguf
from services.models.remote_header import RemoteHeaderError, hub_estimate, read_remote_gguf


class _Files(BaseHTTPRequestHandler):
    """Serves files by path, with byte ranges as the Hub's CDN does (or without, ``/plain/``);
    ``/moved/...`` redirects to the same server under another host name."""

    root: ClassVar[Path]
    served: ClassVar[list[int]] = []
    auth: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        host = self.headers.get("Host", "")
        self.auth.append((host.split(":")[0], self.headers.get("Authorization")))
        if self.path.startswith("/moved/"):
            self.send_response(302)
            port = self.server.server_port  # type: ignore[attr-defined]
            self.send_header("Location", f"http://localhost:{port}/{self.path[7:]}")
            self.end_headers()
            return
        plain = self.path.startswith("/plain/")
        name = self.path.rpartition("/")[2]
        path = self.root / name
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if m is None or plain:
            self.send_response(200)
            body = data
        else:
            start, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.served.append(len(body))

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def files(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served")
    (root / smollm2_path.name).symlink_to(smollm2_path)
    split_gguf(smollm2_path, root / "smol", max_tensors=120)
    return root


@pytest.fixture
def server(files: Path) -> Iterator[str]:
    _Files.root = files
    _Files.served.clear()
    _Files.auth.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def test_the_header_is_read_without_the_tensors(
    server: str, files: Path, smollm2_path: Path
) -> None:
    remote = read_remote_gguf(f"{server}/{smollm2_path.name}")
    assert remote.info == read_gguf(smollm2_path)  # every number, and the file's size
    size = smollm2_path.stat().st_size
    assert remote.fetched_bytes == sum(_Files.served) < size // 10


def test_a_split_model_counts_every_part(server: str, files: Path) -> None:
    first = files / "smol-00001-of-00003.gguf"
    remote = read_remote_gguf(f"{server}/{first.name}")
    assert remote.info.size_bytes == read_gguf(first).size_bytes  # all three parts
    assert remote.info.n_layers == 30
    assert remote.fetched_bytes < first.stat().st_size // 10


def test_a_card_estimates_from_the_hubs_header(
    server: str, files: Path, smollm2_path: Path
) -> None:
    card = ModelCard(id="smol", source=HfSource(repo="someone/smol", filename=smollm2_path.name))
    estimate = hub_estimate(card, endpoint=server)
    facts = model_facts(smollm2_path)
    assert (estimate.n_layers, estimate.size_bytes, estimate.kv_bytes_per_token) == (
        facts.n_layers,
        facts.size_bytes,
        facts.kv_bytes_per_token,
    )
    with pytest.raises(RemoteHeaderError, match="not a GGUF file on the Hugging Face Hub"):
        hub_estimate(card_for("smollm2-135m"))  # its weights are a package's


def test_the_token_goes_to_its_own_host_only(server: str, smollm2_path: Path) -> None:
    read_remote_gguf(f"{server}/moved/{smollm2_path.name}", token="secret")
    hosts = dict(_Files.auth[:2])
    assert hosts == {"127.0.0.1": "Bearer secret", "localhost": None}


def test_a_server_without_ranges_or_the_file_is_an_error(server: str, smollm2_path: Path) -> None:
    with pytest.raises(RemoteHeaderError, match="does not answer range requests"):
        read_remote_gguf(f"{server}/plain/{smollm2_path.name}")
    with pytest.raises(RemoteHeaderError, match="HTTP 404"):
        read_remote_gguf(f"{server}/missing.gguf")
