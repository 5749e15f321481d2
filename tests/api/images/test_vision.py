"""Which models take images (api/images/vision.py): a GGUF model with a projector file, an MLX
model with a vision tower, the projection's row once added, its catalogue card before; and what
the model lists say of it. Pure: rows and cards in."""

from __future__ import annotations

from api.images.vision import accepts_images, engine_of, no_images
from api.model_list import askable
from api.model_names import names_from
from api.ollama.models import capabilities, listed, show
from events.catalogue import ModelAdded, WeightFile
from projectors.rules import fold
from projectors.state import ClusterState
from services.models.catalogue import builtin_cards, card_for
from services.planner.card_fit import card_info
from services.planner.placement import ModelInfo

WEIGHTS = WeightFile(name="m.gguf", object=f"sha256/{'a' * 64}", size=1000, sha256="a" * 64)
PROJECTOR = WeightFile(
    name="mmproj.gguf", object=f"sha256/{'b' * 64}", size=300, sha256="b" * 64, projector=True
)


def _state() -> ClusterState:
    return fold(
        [
            ModelAdded(
                model_id="seeing",
                origin="t",
                n_layers=4,
                size_bytes=1000,
                files=[WEIGHTS, PROJECTOR],
            ),
            ModelAdded(model_id="blind", origin="t", n_layers=4, size_bytes=1000, files=[WEIGHTS]),
            # A card that reads images, added from a file without its projector: text only.
            ModelAdded(model_id="smolvlm-256m", origin="t", n_layers=30, size_bytes=10),
            ModelAdded(model_id="old", origin="t", n_layers=4, size_bytes=1000, path="/m.gguf"),
            ModelAdded(
                model_id="mlx-seeing",
                origin="t",
                n_layers=4,
                size_bytes=10,
                engines=["mlx"],
                vision=True,
            ),
            ModelAdded(
                model_id="mlx-blind", origin="t", n_layers=4, size_bytes=10, engines=["mlx"]
            ),
        ]
    )


def test_a_model_takes_images_when_it_has_a_projector() -> None:
    state = _state()
    rows = {m.model_id: m for m in state.models()}
    assert accepts_images(rows["seeing"], None)
    assert not accepts_images(rows["blind"], None) and not accepts_images(rows["old"], None)
    # The cluster's row wins over the card once the model is added.
    assert not accepts_images(rows["smolvlm-256m"], card_for("smolvlm-256m"))
    # A card not added yet: its projector says (a request for it adds it with its projector).
    assert accepts_images(None, card_for("qwen2.5-vl-3b"))
    assert not accepts_images(None, card_for("smollm2-135m"))
    assert not accepts_images(None, None)
    # MLX: a directory with a vision tower (mlx-vlm's conversions), its card before.
    assert accepts_images(rows["mlx-seeing"], None)
    assert not accepts_images(rows["mlx-blind"], None)
    assert accepts_images(None, card_for("gemma3-4b:mlx-4bit"))
    assert not accepts_images(None, card_for("qwen3-8b:mlx-4bit"))
    # The projector counts in placement's memory, a card's before it is added.
    info = ModelInfo.of(rows["seeing"])
    assert info.footprint.weights_bytes == 1300
    qwen = card_info(card_for("qwen2.5-vl-3b"))
    assert qwen is not None and qwen.footprint.weights_bytes == 1_929_901_056 + 844_757_728


def test_a_refusal_on_mlx_says_the_weights_hold_no_vision_tower() -> None:
    mlx = card_for("qwen3-8b:mlx-4bit")
    assert engine_of(None, mlx) == "mlx"
    said = no_images("qwen3-8b:mlx-4bit", engine_of(None, mlx))
    assert "its MLX weights hold no vision tower" in said
    assert "such as gemma3-4b:mlx-4bit" in said
    rows = {m.model_id: m for m in _state().models()}
    assert engine_of(rows["blind"], None) == "llamacpp"
    assert "such as `shoal models add ID --mmproj FILE`" in no_images("blind")


def test_the_model_lists_say_vision() -> None:
    state = _state()
    entries = {e.name: e for e in askable(state, names_from(state, {}, None), builtin_cards())}
    assert entries["seeing"].capabilities == ["completion", "vision"]
    assert entries["blind"].capabilities == ["completion"]
    assert entries["qwen2.5-vl-7b"].capabilities == ["completion", "vision"]
    assert listed(entries["seeing"])["capabilities"] == ["completion", "vision"]
    assert listed(entries["qwen3-8b"])["capabilities"] == ["completion"]
    seeing = entries["seeing"].model
    assert seeing is not None
    assert show(seeing, 2048, {"chat"})["capabilities"] == ["completion", "tools", "vision"]
    assert capabilities({"embed"}, vision=True) == ["embedding"]  # no chat: no images
