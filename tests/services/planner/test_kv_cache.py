"""KV-cache types: placement counts the cache at its type's size (f16 2 bytes an element,
q8_0 34 and q4_0 18 bytes a block of 32), and ``auto`` takes f16, else the smallest type
that fits, saying what it tried when none does.

The model here has 2 GiB of weights and an f16 KV cache of 512 KiB a token (1 GiB per 2048
tokens); one slot. A node offering 10 GiB has 9 GiB usable.
"""

from __future__ import annotations

from dataclasses import replace

from events.catalogue import InstancePlaced, ModelAdded, PlacementRejected
from events.kinds import KvCacheRequest
from events.units import GiB
from services.models.footprint import Footprint, kv_bytes_per_token
from services.planner.cluster import cluster_view
from services.planner.kv_cache import kv_cache_candidates, kv_cache_problem
from services.planner.placement import PlacementRequest, place
from tests.services.planner.builders import (
    ask,
    fold_all,
    model,
    node,
    placement,
    rejection,
    request,
    settle,
    view,
)

KV = GiB // 2048  # f16 bytes per token: 1 GiB per 2048 tokens


def two_gib(engine: str = "llamacpp") -> ModelAdded:
    return model(size=2 * GiB, kv=KV, engine="mlx" if engine == "mlx" else "llamacpp")


def asking(kv_cache: KvCacheRequest, context_length: int, replicas: int = 1) -> PlacementRequest:
    asked = ask(two_gib(), context_length=context_length, replicas=replicas)
    return replace(asked, kv_cache=kv_cache)


# --- the sizes ------------------------------------------------------------------------------


def test_bytes_per_token_scale_with_the_type() -> None:
    # 64 bytes of f16 are 32 elements: one block.
    assert kv_bytes_per_token(64, "f16") == 64
    assert kv_bytes_per_token(64, "q8_0") == 34
    assert kv_bytes_per_token(64, "q4_0") == 18
    # Rounded up: never promise too little.
    assert kv_bytes_per_token(1, "q8_0") == 1
    assert kv_bytes_per_token(KV, "q8_0") == KV * 17 // 32


def test_a_footprint_converts_once() -> None:
    fp = Footprint(n_layers=32, weights_bytes=GiB, kv_bytes_per_token=64, overhead_bytes=0)
    q8 = fp.with_kv_cache("q8_0")
    assert (q8.kv_bytes_per_token, q8.kv_cache) == (34, "q8_0")
    assert q8.need_bytes(1000) == GiB + 34_000
    try:
        q8.with_kv_cache("q4_0")
    except ValueError:
        pass
    else:
        raise AssertionError("a converted footprint converted again")


# --- placement -------------------------------------------------------------------------------


def test_a_named_type_is_placed_at_its_size() -> None:
    # 8 GiB of f16 cache at 16384 tokens; q8_0 holds it in 4.25 GiB.
    cluster = view(node("a", 10 * GiB))
    result = placement(place(cluster, asking("q8_0", 16384)))
    assert result.kv_cache == "q8_0"
    assert result.need_bytes == 2 * GiB + KV * 17 // 32 * 16384
    assert "KV cache 8.00 GiB, engine" in rejection(place(cluster, asking("f16", 16384))).reason
    assert "KV cache 8.50 GiB q8_0" in rejection(place(cluster, asking("q8_0", 32768))).reason


def test_auto_prefers_f16_when_it_fits() -> None:
    result = placement(place(view(node("a", 10 * GiB)), asking("auto", 8192)))
    assert result.kv_cache == "f16"


def test_auto_takes_the_largest_type_that_fits() -> None:
    cluster = view(node("a", 10 * GiB))
    assert placement(place(cluster, asking("auto", 16384))).kv_cache == "q8_0"
    # 16 GiB of f16 cache: q8_0 needs 8.5 GiB of it, q4_0 4.5 GiB.
    assert placement(place(cluster, asking("auto", 32768))).kv_cache == "q4_0"


def test_auto_says_what_it_tried() -> None:
    # 32 GiB of f16 cache: even q4_0's 9 GiB and the weights are more than 9 GiB.
    refused = rejection(place(view(node("a", 10 * GiB)), asking("auto", 65536)))
    assert refused.reason.startswith("kv_cache auto tried f16, q8_0, q4_0; with the smallest")
    assert "KV cache 9.00 GiB q4_0" in refused.reason
    assert refused.needed_bytes == 11 * GiB


def test_a_refusal_not_about_memory_is_not_retried() -> None:
    refused = rejection(place(view(node("a", 10 * GiB)), asking("auto", 2048, replicas=0)))
    assert not refused.reason.startswith("kv_cache auto")


def test_a_quantized_cache_is_not_split_over_nodes() -> None:
    # Two nodes of 5.4 GiB usable: q8_0's 6.25 GiB would be a pipeline of both, which keeps
    # f16; q4_0's 4.25 GiB fits one; auto takes f16, split.
    cluster = view(node("a", 6 * GiB), node("b", 6 * GiB))
    refused = rejection(place(cluster, asking("q8_0", 16384)))
    assert refused.reason.startswith("kv_cache q8_0: m would be split over several nodes")
    q4 = placement(place(cluster, asking("q4_0", 16384)))
    assert [s.world_size for s in q4.shards] == [1]
    split = placement(place(cluster, asking("auto", 16384)))
    assert split.kv_cache == "f16" and [s.world_size for s in split.shards] == [2, 2]


def test_placed_again_auto_tries_the_type_the_runners_use_first() -> None:
    assert kv_cache_candidates("llamacpp", "chat", "auto") == ("f16", "q8_0", "q4_0")
    assert kv_cache_candidates("llamacpp", "chat", "auto", "q8_0") == ("q8_0", "f16", "q4_0")
    assert kv_cache_candidates("llamacpp", "chat", "q4_0", "f16") == ("q4_0",)


def test_mlx_and_embeddings_keep_an_f16_cache() -> None:
    assert kv_cache_candidates("mlx", "chat", "auto") == ("f16",)
    assert kv_cache_problem("mlx", "chat", "f16") is None
    assert kv_cache_problem("mlx", "chat", "auto") is None
    problem = kv_cache_problem("mlx", "chat", "q8_0")
    assert problem is not None and problem.startswith("kv_cache q8_0: the mlx engine")
    assert kv_cache_candidates("llamacpp", "embed", "auto") == ("f16",)
    embed = kv_cache_problem("llamacpp", "embed", "q8_0")
    assert (
        embed
        == "kv_cache q8_0: an embed instance keeps its KV cache in f16 only; ask for f16 or auto"
    )
    req = replace(ask(two_gib("mlx")), kv_cache="q4_0")
    assert rejection(place(view(node("a", 10 * GiB)), req)).reason.startswith("kv_cache q4_0")


# --- the planner -----------------------------------------------------------------------------


def test_the_planner_records_the_type_it_chose_and_counts_it() -> None:
    asked = request("i", context_length=16384).model_copy(update={"kv_cache": "auto"})
    state = fold_all(node("a", 10 * GiB), two_gib(), asked)
    (decision,) = settle(state, 3)
    assert isinstance(decision.event, InstancePlaced) and decision.event.kv_cache == "q8_0"
    inst = state.instance("i")
    assert inst is not None and (inst.requested_kv_cache, inst.kv_cache) == ("auto", "q8_0")
    # The placed shard holds the q8_0 cache, not the f16 one.
    held = 2 * GiB + KV * 17 // 32 * 16384
    assert cluster_view(state).devices["a:cpu"].reserved == held
    # A second such instance does not fit beside it, whatever the type.
    more = request("j", context_length=65536, t=4).model_copy(update={"kv_cache": "auto"})
    fold_all(more, state=state)
    (refused,) = settle(state, 5)
    assert isinstance(refused.event, PlacementRejected)
    assert "kv_cache auto tried f16, q8_0, q4_0" in refused.event.reason


def test_an_old_log_places_f16() -> None:
    state = fold_all(node("a", 10 * GiB), two_gib(), request("i"))
    (decision,) = settle(state, 3)
    assert isinstance(decision.event, InstancePlaced) and decision.event.kv_cache == "f16"
    inst = state.instance("i")
    assert inst is not None and (inst.requested_kv_cache, inst.kv_cache) == ("f16", "f16")
