"""A GGUF split into parts (``<prefix>-00001-of-00003.gguf``...), made from SmolLM2 with the
gguf package: read as one model, loaded by llama.cpp, resolved from a Hub cache without the
network, and carried through the models bucket to another node's cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants
from llama_cpp import Llama
from nats.aio.client import Client
from nats.js import JetStreamContext

from harness.models.split_gguf import split_gguf
from services.models.cards import HfSource, ModelCard
from services.models.metadata import GgufError, model_facts, read_gguf
from services.models.resolve import local_path, resolve_model
from services.models.shared import model_files, shard_model_path, store_files
from services.models.weights_cache import WeightsCache
from tests.services.models.hub_cache import hub_cache

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def parts(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("split")
    return split_gguf(smollm2_path, out / "smol", max_tensors=120)


def _greedy(path: Path) -> str:
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    try:
        text = llm(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]  # type: ignore[index]
        return str(text)
    finally:
        llm.close()


def test_a_split_gguf_reads_as_one_model_and_loads(parts: list[Path], smollm2_path: Path) -> None:
    assert [p.name for p in parts] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    info = read_gguf(parts[0])
    whole = read_gguf(smollm2_path)
    assert (info.n_layers, info.context_length, info.vocab_size) == (30, 8192, 49152)
    assert info.size_bytes == sum(p.stat().st_size for p in parts)  # all parts, not the first
    assert abs(info.size_bytes - whole.size_bytes) < 4096  # the same tensors, other headers
    assert model_facts(parts[0]).kv_bytes_per_token == model_facts(smollm2_path).kv_bytes_per_token
    # llama.cpp finds the other parts by name beside the first and answers as the whole file.
    assert _greedy(parts[0]) == _greedy(smollm2_path)


def test_a_split_gguf_with_a_part_missing_says_which(parts: list[Path], tmp_path: Path) -> None:
    first = tmp_path / parts[0].name
    first.symlink_to(parts[0])
    (tmp_path / parts[2].name).symlink_to(parts[2])
    with pytest.raises(GgufError, match=r"missing: smol-00002-of-00003\.gguf"):
        read_gguf(first)


def test_a_split_gguf_resolves_from_a_hub_cache_offline(
    parts: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    repo = "someone/Smol-GGUF"
    hub_cache(tmp_path / "hf", repo, {f"Q4/{p.name}": p for p in parts})
    card = ModelCard(id="smol", source=HfSource(repo=repo, filename=f"Q4/{parts[0].name}"))
    path = resolve_model(card, tmp_path)
    assert path.name == parts[0].name and local_path(card, tmp_path) == path
    assert read_gguf(path).size_bytes == sum(p.stat().st_size for p in parts)
    # With a part missing from the cache it is not there (and offline, a clear error).
    missing = ModelCard(id="x", source=HfSource(repo=repo, filename="Q4/other-00001-of-00002.gguf"))
    assert local_path(missing, tmp_path) is None


async def test_a_split_gguf_goes_through_the_bucket_and_loads_on_another_node(
    nc: Client, js: JetStreamContext, parts: list[Path], tmp_path: Path
) -> None:
    files = await store_files(js, model_files(parts[0]))
    assert [f.name for f in files] == [p.name for p in parts]
    cache = WeightsCache(tmp_path / "node")
    path = await shard_model_path(
        nc, cache, "smol", files, engine="llamacpp", rank=0, start=0, end=30, n_layers=30
    )
    assert path == cache.model_dir("smol") / parts[0].name
    assert sorted(p.name for p in path.parent.iterdir()) == [p.name for p in parts]
    assert read_gguf(path).n_layers == 30
    assert _greedy(path) == _greedy(parts[0])  # loaded through the cache's links
