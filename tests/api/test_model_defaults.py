"""Per-model defaults for models loaded on demand (api/model_defaults.py, pure): the file read,
each mistake refused naming the model and the key, and what an on-demand instance request
takes from them (api/on_demand.py's ``requested``)."""

from __future__ import annotations

import json

import pytest

from api.model_defaults import ModelDefault, ModelDefaults, ModelDefaultsError, parse_model_defaults
from api.model_names import ModelNames
from api.on_demand import instance_id_for, requested
from events.catalogue import InstanceDeleted, InstanceRequested, ModelAdded
from events.records import Speculative
from events.units import GiB
from projectors.rules import fold
from services.planner.decisions import PlannerPolicy, decide
from services.planner.placement_spec import parse_placement_spec
from tests.services.planner.builders import at, fold_all, model, node

FILE = {
    "qwen3-8b": {"keep_alive": "30m", "context_length": 8192, "max_tokens": 512},
    "long": {"context_length": 32768, "kv_cache": "auto"},
    "smollm2-135m": {"pinned": True},
    "gemma3-270m:latest": {"keep_alive": -1},
    "gpt-4o": {"keep_alive": 90},
    "nomic": {
        "keep_alive": "0",
        "placement": {"embed": {"devices": ["node-a:CUDA0"]}, "chat": {"devices": ["b:cpu"]}},
    },
    "placed-as-text": {"placement": '{"chat": {"devices": ["a:cpu"], "slots": 2}}'},
    "nothing": {},
    "nulls": {
        "keep_alive": None,
        "pinned": None,
        "placement": None,
        "context_length": None,
        "max_tokens": None,
        "kv_cache": None,
    },
}


def _parsed(data: object, aliases: dict[str, str] | None = None) -> ModelDefaults:
    return parse_model_defaults(json.dumps(data), aliases)


def _refused(data: object, aliases: dict[str, str] | None = None) -> str:
    with pytest.raises(ModelDefaultsError) as refused:
        _parsed(data, aliases)
    return str(refused.value)


def test_a_file_of_defaults_is_read() -> None:
    defaults = _parsed(FILE, {"gpt-4o": "qwen3-8b:q8_0"})
    got = defaults.by_name
    assert got["qwen3-8b"] == ModelDefault(keep_alive_s=1800.0, context_length=8192, max_tokens=512)
    assert got["smollm2-135m"] == ModelDefault(pinned=True)
    assert got["gemma3-270m:latest"].keep_alive_s == -1.0
    assert got["gpt-4o"].keep_alive_s == 90.0
    assert got["nomic"].keep_alive_s == 0.0
    assert got["nothing"] == got["nulls"] == ModelDefault()
    # Devices as the placement spec writes them (lowercase), the role's entry alone.
    assert got["nomic"].placement_for("embed") == '{"embed":{"devices":["node-a:cuda0"]}}'
    assert got["nomic"].placement_for("chat") == '{"chat":{"devices":["b:cpu"]}}'
    assert got["nomic"].placement_for("rerank") is None  # placed as usual
    assert got["placed-as-text"].placement_for("chat") == (
        '{"chat":{"devices":["a:cpu"],"slots":2}}'
    )
    assert got["qwen3-8b"].placement_for("chat") is None
    assert parse_model_defaults("{}") == ModelDefaults()


def test_a_request_s_own_keep_alive_wins() -> None:
    kept = ModelDefault(keep_alive_s=600.0)
    assert kept.keep_alive_for(None) == 600.0
    assert kept.keep_alive_for(0.0) == 0.0
    assert ModelDefault().keep_alive_for(None) is None  # the planners' default


def test_a_model_s_defaults_are_found_by_any_name_it_has() -> None:
    defaults = _parsed(FILE, {"gpt-4o": "qwen3-8b:q8_0"})
    names = ModelNames(
        ids=frozenset({"qwen3-8b"}),
        aliases={"gpt-4o": "qwen3-8b:q8_0"},
        catalogue=frozenset({"gemma3-270m", "qwen3-8b:q8_0"}),
    )
    assert defaults.for_model("qwen3-8b", names.resolve) == ModelDefault(
        keep_alive_s=1800.0, context_length=8192, max_tokens=512
    )
    gemma = defaults.for_model("gemma3-270m", names.resolve)  # "gemma3-270m:latest"
    assert gemma is not None and gemma.keep_alive_s == -1.0
    q8 = defaults.for_model("qwen3-8b:q8_0", names.resolve)  # by its alias
    assert q8 is not None and q8.keep_alive_s == 90.0
    assert defaults.for_model("phi4", names.resolve) is None


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("[]", "a JSON object keyed by model name"),
        ("{", "not valid JSON"),
        ({"m": "10m"}, "model 'm': its defaults are a JSON object"),
        ({"m": {"keepalive": "10m"}}, "model 'm': unknown key 'keepalive' (allowed keys:"),
        ({"m": {"keep_alive": "ten minutes"}}, "model 'm': keep_alive: 'ten minutes' is not a"),
        ({"m": {"keep_alive": "10 parsecs"}}, "model 'm': keep_alive: '10 parsecs' is not a"),
        ({"m": {"keep_alive": True}}, "model 'm': keep_alive: a duration"),
        ({"m": {"keep_alive": [1]}}, "model 'm': keep_alive: a duration"),
        ({"m": {"pinned": "yes"}}, "model 'm': pinned: true or false, not the string 'yes'"),
        ({"m": {"pinned": True, "keep_alive": "5m"}}, "model 'm': keep_alive: a pinned model"),
        ({"m": {"context_length": 0}}, "model 'm': context_length: a whole number"),
        ({"m": {"context_length": 2048.5}}, "model 'm': context_length: a whole number"),
        ({"m": {"context_length": "2048"}}, "model 'm': context_length: a whole number"),
        ({"m": {"max_tokens": 0}}, "model 'm': max_tokens: a whole number of tokens, 1 or"),
        ({"m": {"max_tokens": -1}}, "model 'm': max_tokens: a whole number of tokens, 1 or"),
        ({"m": {"placement": 3}}, "model 'm': placement: a placement spec"),
        ({"m": {"placement": {"chat": {}}}}, "model 'm': placement: role 'chat': 'devices' is"),
        (
            {"m": {"placement": {"chat": {"devices": ["a"]}}}},
            "model 'm': placement: role 'chat': devices[0]: 'a' is not a device",
        ),
        ({"m": {"placement": {"talk": {"devices": ["a:cpu"]}}}}, "unknown role 'talk'"),
        ({"m": {"placement": "{nope"}}, "model 'm': placement: the placement is not valid JSON"),
        ({" m": {}}, "model ' m': a model's name"),
        ({"": {}}, "model '': a model's name"),
        ('{"m": {}, "m": {}}', "'m' is given twice"),
        ('{"m": {"pinned": true, "pinned": false}}', "'pinned' is given twice"),
        ({"m": {}, "m:latest": {}}, "models 'm' and 'm:latest' are the same model (m)"),
    ],
)
def test_each_mistake_is_named(data: object, says: str) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    with pytest.raises(ModelDefaultsError) as refused:
        parse_model_defaults(text)
    assert says in str(refused.value)


def test_two_names_of_one_model_by_the_api_s_aliases_are_refused() -> None:
    says = _refused({"gpt-4o": {}, "qwen3-8b": {}}, {"gpt-4o": "qwen3-8b"})
    assert says == (
        "models 'gpt-4o' and 'qwen3-8b' are the same model (qwen3-8b): give its defaults once"
    )


# --- what an on-demand instance request takes from them -------------------------------------


STATE = [ModelAdded(model_id="m", origin="t", n_layers=4, size_bytes=1)]


def test_an_on_demand_request_carries_the_defaults() -> None:
    state = fold(STATE)
    spec = parse_placement_spec('{"chat": {"devices": ["a:cpu"]}, "embed": {"devices": ["b:cpu"]}}')
    given = ModelDefault(keep_alive_s=600.0, placement=spec, context_length=4096)
    asked = requested(state, "m", "chat", "loaded on demand: POST /api/chat", "api", None, given)
    assert (asked.instance_id, asked.on_demand, asked.keep_alive_s) == (
        "m-chat-on-demand-0",
        True,
        600.0,
    )
    assert (asked.placement, asked.context_length) == ('{"chat":{"devices":["a:cpu"]}}', 4096)
    assert asked.reason == "loaded on demand: POST /api/chat"
    # The request's own keep-alive wins; an embed instance takes the spec's embed entry.
    own = requested(state, "m", "embed", "why", "api", 30.0, given)
    assert (own.keep_alive_s, own.placement) == (30.0, '{"embed":{"devices":["b:cpu"]}}')
    # Without defaults: as before them.
    plain = requested(state, "m", "chat", "why", "api", None, None)
    assert (plain.on_demand, plain.keep_alive_s, plain.placement, plain.context_length) == (
        True,
        None,
        None,
        None,
    )


def test_a_pinned_model_is_asked_for_as_an_explicit_one() -> None:
    state = fold(STATE)
    pinned = requested(state, "m", "chat", "why", "api", 30.0, ModelDefault(pinned=True))
    # on_demand false: never unloaded when idle nor to make room (services/planner/on_demand.py),
    # and a request's keep-alive does not change it (projectors: on-demand instances only).
    assert (pinned.on_demand, pinned.keep_alive_s) == (False, None)
    assert pinned.reason == "why; pinned (--model-defaults)"
    # Still named as on-demand instances are, so that the next one after it gets another id.
    assert pinned.instance_id == "m-chat-on-demand-0"
    after = fold([pinned, InstanceDeleted(instance_id=pinned.instance_id, origin="p")], state)
    assert instance_id_for(after, "m", "chat") == "m-chat-on-demand-1"


def test_a_pinned_model_stays_loaded_when_idle_and_when_another_wants_room() -> None:
    # 9 GiB usable: one 6 GiB model, not two.
    state = fold_all(
        node("a", 10 * GiB, heartbeat_s=86_400), model("p", size=6 * GiB), model("z", size=6 * GiB)
    )
    fold([requested(state, "p", "chat", "why", "api", None, ModelDefault(pinned=True))], state)
    policy = PlannerPolicy(default_keep_alive_s=0.0)
    first = decide(state, at(2), policy)
    assert [type(d.event).__name__ for d in first] == ["InstancePlaced"]
    fold([d.event for d in first], state)
    assert decide(state, at(100_000), policy) == []  # idle for ever: kept
    fold([requested(state, "z", "chat", "why", "api")], state)
    refused = [type(d.event).__name__ for d in decide(state, at(100_001), policy)]
    assert refused == ["PlacementRejected"]  # no room made by unloading it


def test_the_next_id_counts_on_demand_instances_only() -> None:
    state = fold([*STATE, InstanceRequested(instance_id="m-explicit", model_id="m", origin="t")])
    assert instance_id_for(state, "m", "chat") == "m-chat-on-demand-0"


def test_a_kv_cache_type_is_read_and_applies_to_chat_instances() -> None:
    got = _parsed(FILE).by_name["long"]
    assert got == ModelDefault(context_length=32768, kv_cache="auto")
    assert (got.kv_cache_for("chat"), got.kv_cache_for("embed")) == ("auto", "f16")
    assert ModelDefault().kv_cache_for("chat") == "f16"
    assert _refused({"m": {"kv_cache": "q5_1"}}) == (
        "model 'm': kv_cache: one of f16, q8_0, q4_0, auto, not 'q5_1'"
    )
    assert _refused({"m": {"kv_cache": 8}}).startswith("model 'm': kv_cache: one of")
    state = fold_all(node("a", 8 * GiB), model("long", size=GiB))
    asked = requested(state, "long", "chat", "POST /v1/chat/completions", "api", None, got)
    assert (asked.kv_cache, asked.context_length) == ("auto", 32768)


def test_speculative_decoding_is_read_and_asked_for_where_it_can_be() -> None:
    got = _parsed(
        {"m": {"speculative": {"type": "ngram", "draft_max": 8}}, "t": {"speculative": True}}
    )
    assert got.by_name["m"].speculative == Speculative(type="ngram", draft_max=8)
    assert got.by_name["t"].speculative == Speculative(type="ngram")
    assert _refused({"m": {"speculative": "yes"}}) == (
        "model 'm': speculative: an object or true, not the string 'yes'"
    )
    assert "draft_max" in _refused({"m": {"speculative": {"draft_max": 0}}})
    state = fold_all(node("a", 8 * GiB), model("m", size=GiB), model("x", size=GiB, engine="mlx"))
    chat = requested(state, "m", "chat", "POST /v1/chat/completions", "api", None, got.by_name["m"])
    assert chat.speculative == Speculative(type="ngram", draft_max=8)
    embed = requested(state, "m", "embed", "POST /v1/embeddings", "api", None, got.by_name["m"])
    assert embed.speculative is None
    # The operator's file asked it of an MLX model: loaded without it, not a refused request.
    mlx = requested(state, "x", "chat", "POST /v1/chat/completions", "api", None, got.by_name["m"])
    assert mlx.speculative is None
