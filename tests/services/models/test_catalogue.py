"""The catalogue's cards: every file validates, the built-ins' numbers are their weights', a
broken file says which, and a card resolves from a Hugging Face cache without the network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from harness.models.tiny_mlx import make_tiny_mlx_model
from modelfiles.shard_files import SPLIT_GGUF
from services.models.cards import HfSource, ModelCard, PackageSource
from services.models.catalogue import (
    CATALOGUE_DIR,
    CatalogueError,
    card_for,
    catalogue_cards,
    catalogue_entries,
    load_entry,
)
from services.models.metadata import model_facts, read_mlx_config
from services.models.resolve import resolve_model
from tests.services.models.hub_cache import hub_cache

FAMILIES = {
    "qwen3",
    "qwen2.5-vl",
    "smolvlm",
    "llama3",
    "gemma3",
    "mistral",
    "phi3",
    "phi4",
    "deepseek-r1-distill",
    "smollm2",
}


def test_every_card_file_validates_and_ids_are_unique() -> None:
    entries = catalogue_entries()
    assert len(entries) == len(list(CATALOGUE_DIR.glob("*.toml"))) >= 20
    assert {e.family for e in entries} >= FAMILIES
    cards = catalogue_cards()
    assert len(cards) == sum(len(e.cards()) for e in entries)  # no id twice
    for card in cards.values():
        assert card.estimate is not None and card.description
        assert card.estimate.kv_bytes_per_token > 0 and card.estimate.overhead_bytes > 0
        if isinstance(card.source, HfSource):
            assert card.source.repo.count("/") == 1
            if card.engines == ["mlx"]:
                assert card.source.filename is None and ":mlx-" in card.id
            else:
                assert card.source.filename is not None
                assert card.source.filename.endswith(".gguf")
                m = SPLIT_GGUF.search(card.source.filename)
                assert m is None or m.group(1) == "00001"  # a split one names its first part


def test_variants_have_ids_of_their_own() -> None:
    qwen = card_for("qwen3-8b")
    assert (qwen.variant, qwen.engines, qwen.tool_calls) == ("Q4_K_M", ["llamacpp"], "hermes")
    assert qwen.source == HfSource(repo="Qwen/Qwen3-8B-GGUF", filename="Qwen3-8B-Q4_K_M.gguf")
    assert card_for("qwen3-8b:q8_0").source == HfSource(
        repo="Qwen/Qwen3-8B-GGUF", filename="Qwen3-8B-Q8_0.gguf"
    )
    mlx = card_for("qwen3-8b:mlx-4bit")
    assert mlx.engines == ["mlx"] and mlx.source == HfSource(repo="mlx-community/Qwen3-8B-4bit")
    big = card_for("llama3.3-70b:q8_0")
    assert isinstance(big.source, HfSource) and big.source.filename is not None
    assert big.source.filename.endswith("-00001-of-00002.gguf")
    assert card_for("llama3.1-8b").tool_calls == "llama3"
    assert card_for("mistral-7b").tool_calls == "mistral"


def test_a_vision_card_names_its_projector_for_its_gguf_variants() -> None:
    """Images are read with the card's projector file: every GGUF variant takes it, MLX reads
    text only; its size counts in the card's estimate (placement's memory)."""
    seeing = [c for c in catalogue_cards().values() if c.projector is not None]
    assert {c.id for c in seeing} >= {
        "smolvlm-256m",
        "smolvlm-500m",
        "gemma3-4b",
        "qwen2.5-vl-3b",
        "qwen2.5-vl-7b",
    }
    smol = card_for("smolvlm-256m")
    assert smol.source == HfSource(
        repo="ggml-org/SmolVLM-256M-Instruct-GGUF", filename="SmolVLM-256M-Instruct-Q8_0.gguf"
    )
    assert smol.projector == HfSource(
        repo="ggml-org/SmolVLM-256M-Instruct-GGUF",
        filename="mmproj-SmolVLM-256M-Instruct-Q8_0.gguf",
    )
    for card in seeing:
        assert card.engines == ["llamacpp"] and card.estimate is not None
        assert card.estimate.projector_bytes > 10**7
        assert isinstance(card.projector, HfSource) and card.projector.filename
        assert card.projector.filename.startswith("mmproj-")
    assert card_for("gemma3-4b:q8_0").projector == card_for("gemma3-4b").projector
    assert card_for("gemma3-4b:mlx-4bit").projector is None
    with pytest.raises(ValueError, match="a projector file is llama\\.cpp's"):
        ModelCard.model_validate(
            card_for("gemma3-4b:mlx-4bit").model_dump() | {"projector": smol.projector}
        )


def test_the_built_in_cards_estimates_are_what_their_weights_say(
    smollm2_path: Path, gemma_path: Path
) -> None:
    for card_id, path in (("smollm2-135m", smollm2_path), ("gemma3-270m", gemma_path)):
        card = card_for(card_id)
        assert isinstance(card.source, PackageSource) and card.variant == "package"
        facts = model_facts(path)
        assert card.estimate is not None
        assert card.estimate.model_dump() == {
            "n_layers": facts.n_layers,
            "context_length": facts.context_length,
            "size_bytes": facts.size_bytes,
            "kv_bytes_per_token": facts.kv_bytes_per_token,
            "overhead_bytes": facts.overhead_bytes,
            "projector_bytes": 0,  # they read text only
        }


def test_a_broken_card_file_says_which_and_why(tmp_path: Path) -> None:
    good = (CATALOGUE_DIR / "qwen3-8b.toml").read_text()
    (tmp_path / "qwen3-8b.toml").write_text(good.replace('default = "Q4_K_M"', 'default = "Q5"'))
    with pytest.raises(CatalogueError, match=r"qwen3-8b\.toml: .*default 'Q5' is none of"):
        load_entry(tmp_path / "qwen3-8b.toml")
    (tmp_path / "other.toml").write_text(good)
    with pytest.raises(CatalogueError, match="its id is 'qwen3-8b', not the file's name"):
        load_entry(tmp_path / "other.toml")
    (tmp_path / "bad.toml").write_text("id = [")
    with pytest.raises(CatalogueError, match=r"bad\.toml"):
        load_entry(tmp_path / "bad.toml")
    (tmp_path / "x.toml").write_text(good.replace("qwen3-8b", "x").replace("[gguf]", "[gguff]"))
    with pytest.raises(CatalogueError, match="gguff"):  # unknown tables are refused
        load_entry(tmp_path / "x.toml")


def test_a_card_resolves_from_a_hub_cache_without_the_network(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a machine that downloaded the model once has: offline, nothing else is needed."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    card = card_for("qwen3-0.6b")
    assert isinstance(card.source, HfSource) and card.source.filename is not None
    hub_cache(tmp_path / "hf", card.source.repo, {card.source.filename: smollm2_path})
    path = resolve_model(card, tmp_path)
    assert path.name == card.source.filename and path.read_bytes()[:4] == b"GGUF"

    # An MLX card is a whole repository.
    tiny = make_tiny_mlx_model(tmp_path / "tiny")
    mlx = card_for("qwen3-0.6b:mlx-4bit")
    assert isinstance(mlx.source, HfSource)
    hub_cache(tmp_path / "hf", mlx.source.repo, {p.name: p for p in tiny.iterdir()})
    directory = resolve_model(mlx, tmp_path)
    assert directory.is_dir() and json.loads((directory / "config.json").read_text())
    assert read_mlx_config(directory).n_layers == 4

    # Not in the cache and offline: the clear error, not a hang.
    with pytest.raises(Exception, match="HF_HUB_OFFLINE"):
        resolve_model(card_for("qwen3-4b"), tmp_path)
