"""Every model a client can ask for (api/model_list.py, pure): the models the cluster knows and
their aliases, then the catalogue's cards not added yet, each saying whether it is added and
loaded; OpenAI's and Ollama's entries made of them, read back by the real SDKs' types."""

from __future__ import annotations

import ollama
import openai.types

from api.model_list import askable
from api.model_names import ModelNames, names_from
from api.ollama.models import listed
from api.openai.routes import _model
from events.catalogue import InstanceRequested, ModelAdded, ModelRemoved
from events.units import MiB
from projectors.rules import fold
from projectors.state import ClusterState
from services.models.catalogue import builtin_cards
from tests.services.planner.builders import at, placed, runner_state, shard

CARDS = builtin_cards()
SMOL, GEMMA = "smollm2-135m", "gemma3-270m"


def _cluster() -> ClusterState:
    """``m`` (no card) and SmolLM2 (a card) added, SmolLM2 served, ``m`` not."""
    return fold(
        [
            ModelAdded(model_id="m", origin="t", n_layers=4, size_bytes=MiB, ts=at(10)),
            ModelAdded(model_id=SMOL, origin="t", n_layers=30, size_bytes=90 * MiB, ts=at(20)),
            InstanceRequested(instance_id="s", model_id=SMOL, origin="t", aliases=["gpt-x"]),
            placed("s", [shard("r", "a", (0, 30), 30)], model_id=SMOL),
            runner_state("r", "s", "a", "Ready", t=3),
        ]
    )


def test_the_known_models_and_their_aliases_then_the_cards_not_added() -> None:
    state = _cluster()
    names = names_from(state, {"mine": "m", GEMMA: "m", "gone": "nowhere", "g": GEMMA}, None)
    entries = askable(state, names, CARDS)
    head = [(e.name, e.model_id, e.added, e.loaded) for e in entries[:5]]
    assert head == [
        ("m", "m", True, False),
        (SMOL, SMOL, True, True),
        ("g", GEMMA, False, False),  # an alias of a card: asked for, it loads it
        (GEMMA, "m", True, False),  # an alias the API was given wins over the card's name
        ("gpt-x", SMOL, True, True),
    ]
    assert "gone" not in {e.name for e in entries}  # an alias of nothing: nothing answers it
    cards = entries[6:]
    assert {e.name for e in cards} == set(CARDS) - {SMOL, GEMMA}  # each card once
    assert all(not e.added and not e.loaded and e.card is not None for e in cards)
    assert entries[5].name == "mine"
    assert entries[0].created == int(at(10).timestamp()) and cards[0].created == 0


def test_a_removed_catalogue_model_is_listed_again_as_not_added() -> None:
    state = _cluster()
    fold([ModelRemoved(model_id=SMOL, origin="t")], state)
    entries = {e.name: e for e in askable(state, names_from(state, {}, None), CARDS)}
    smol = entries[SMOL]
    assert (smol.added, smol.model, smol.card) == (False, None, CARDS[SMOL])
    shown = listed(smol)
    assert (shown["added"], shown["size"], shown["modified_at"]) == (
        False,
        0,
        "1970-01-01T00:00:00Z",
    )


def test_openai_s_sdk_reads_the_entries() -> None:
    state = _cluster()
    entries = askable(state, names_from(state, {}, None), CARDS)
    made = [_model(e) for e in entries]
    models = [openai.types.Model.model_validate(m) for m in made]
    assert [m.id for m in models[:3]] == ["m", SMOL, "gpt-x"]
    by_id = {m["id"]: m for m in made}
    assert by_id[SMOL] | {"created": 0} == {
        "id": SMOL,
        "object": "model",
        "owned_by": "shoal",
        "created": 0,
        "loaded": True,
        "added": True,
        "capabilities": ["completion"],
    }
    assert by_id["gpt-x"]["alias_of"] == SMOL
    assert by_id[GEMMA] == {
        "id": GEMMA,
        "object": "model",
        "owned_by": "shoal",
        "created": 0,
        "loaded": False,
        "added": False,
        "capabilities": ["completion"],
    }
    assert models[-1].model_extra is not None
    assert set(models[-1].model_extra) == {"loaded", "added", "capabilities"}
    # A card with a projector file reads images.
    assert by_id["smolvlm-256m"]["capabilities"] == ["completion", "vision"]


def test_ollama_s_client_reads_the_entries() -> None:
    state = _cluster()
    entries = askable(state, names_from(state, {}, None), CARDS)
    body = {"models": [listed(e) for e in entries]}
    parsed = {m.model: m for m in ollama.ListResponse.model_validate(body).models}
    assert set(parsed) == {"m:latest", f"{SMOL}:latest", "gpt-x:latest"} | {
        c if ":" in c else f"{c}:latest" for c in CARDS
    }
    smol, gemma = parsed[f"{SMOL}:latest"], parsed[f"{GEMMA}:latest"]
    assert smol.size == 90 * MiB and gemma.size == 0  # nothing of it here yet
    assert gemma.details is not None and gemma.details.family == "gemma3"
    assert gemma.details.format == "gguf" and gemma.details.parameter_size == "270M"
    assert gemma.digest and gemma.digest != smol.digest
    mlx = parsed["qwen3-8b:mlx-4bit"]
    assert mlx.details is not None and mlx.details.format == "mlx"
    shown = {e["name"]: e for e in body["models"]}
    assert (shown[f"{SMOL}:latest"]["loaded"], shown[f"{SMOL}:latest"]["added"]) == (True, True)
    assert (shown[f"{GEMMA}:latest"]["loaded"], shown[f"{GEMMA}:latest"]["added"]) == (
        False,
        False,
    )


def test_a_card_s_name_with_latest_means_the_card() -> None:
    names = ModelNames(ids=frozenset({"m"}), catalogue=frozenset({GEMMA, "qwen3-8b:q8_0"}))
    assert names.resolve(f"{GEMMA}:latest") == GEMMA  # as /api/tags lists it
    assert names.resolve("qwen3-8b:q8_0") == "qwen3-8b:q8_0"
    assert names.resolve("qwen3-8b:q8_0:latest") == "qwen3-8b:q8_0"
    assert names.resolve("other:latest") == "other:latest"
    shadowed = ModelNames(ids=frozenset({"m"}), aliases={GEMMA: "m"}, catalogue=frozenset({GEMMA}))
    assert shadowed.resolve(GEMMA) == "m"
