"""Whether a catalogue model fits the cluster now, from its card's estimate (before anything is
downloaded) or from what the cluster knows of it."""

from __future__ import annotations

from events.units import GiB
from services.models.catalogue import card_for
from services.planner.card_fit import card_info, fits_now
from tests.services.planner.builders import fold_all, model, node


def test_a_card_estimates_what_placement_needs() -> None:
    info = card_info(card_for("qwen3-8b"))
    assert info is not None
    assert (info.model_id, info.footprint.n_layers, info.context_length) == ("qwen3-8b", 36, 40960)
    # 36 layers x 8 KV heads x 128 x (K and V) x 2 bytes
    assert info.footprint.kv_bytes_per_token == 36 * 8 * 128 * 2 * 2
    assert info.engine == "llamacpp" and card_for("qwen3-8b:mlx-4bit").engines == ["mlx"]


def test_fits_on_one_node_split_over_several_or_not_at_all() -> None:
    one = fold_all(node("a", 16 * GiB))
    assert fits_now(one, card_for("qwen3-8b")) == (True, "a")
    two = fold_all(node("a", 4 * GiB), node("b", 4 * GiB))
    assert fits_now(two, card_for("qwen3-8b")) == (True, "split over 2 nodes")
    fits, why = fits_now(one, card_for("llama3.3-70b"))
    assert not fits and "needs" in why


def test_what_the_cluster_knows_of_a_model_wins_over_its_card() -> None:
    # Added already, and much smaller than its card says (say, another file under that id).
    state = fold_all(node("a", 2 * GiB), model("qwen3-8b", size=1 * GiB, n_layers=36))
    assert fits_now(state, card_for("qwen3-8b")) == (True, "a")
