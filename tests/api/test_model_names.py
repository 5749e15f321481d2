"""The names clients call models by (pure)."""

from __future__ import annotations

import pytest

from api.config import parse_aliases
from api.errors import ApiError
from api.model_names import ModelNames, names_from
from events.catalogue import InstanceRequested, ModelAdded
from projectors.rules import fold

NAMES = ModelNames(
    ids=frozenset({"qwen", "smol"}),
    aliases={"claude-sonnet-4": "qwen", "gpt-4o": "smol"},
    served={"chat": ("qwen", "smol"), "embed": ("smol",)},
)


def test_ids_aliases_and_latest_tags() -> None:
    assert NAMES.resolve("qwen") == "qwen"
    assert NAMES.resolve("claude-sonnet-4") == "qwen"
    assert NAMES.resolve("smol:latest") == "smol"
    assert NAMES.resolve("gpt-4o:latest") == "smol"
    assert NAMES.resolve("unknown") == "unknown"  # the serving check's 404 lists the known


def test_no_name_goes_to_the_default_or_the_only_model_served() -> None:
    assert NAMES.resolve(None, "embed") == "smol"
    with pytest.raises(ApiError) as refused:
        NAMES.resolve(None)
    assert refused.value.status == 400 and "qwen, smol" in refused.value.message
    with_default = ModelNames(NAMES.ids, NAMES.aliases, NAMES.served, default="claude-sonnet-4")
    assert with_default.resolve("") == "qwen"
    assert ModelNames(ids=frozenset({"only"})).resolve(None) == "only"
    with pytest.raises(ApiError, match="none yet"):
        ModelNames().resolve(None)


def test_names_from_the_projection() -> None:
    state = fold(
        [
            ModelAdded(model_id="m", origin="t", n_layers=1, size_bytes=1),
            InstanceRequested(instance_id="i1", model_id="m", origin="t", aliases=["a1"]),
            InstanceRequested(instance_id="i2", model_id="m", origin="t", role="embed"),
        ]
    )
    names = names_from(state, {"a2": "m"}, None)
    assert names.listed() == [("m", "m"), ("a1", "m"), ("a2", "m")]
    assert names.served == {"chat": ("m",), "embed": ("m",), "rerank": ()}


def test_aliases_from_the_command_line_and_the_environment() -> None:
    assert parse_aliases(["b=m2"], env="a=m1, b=m1") == {"a": "m1", "b": "m2"}
    with pytest.raises(ValueError, match="NAME=MODEL"):
        parse_aliases(["nomodel"], env="")
