"""Who may change the cluster through a request (api/on_demand.py, `--on-demand`): unloading
(Ollama's keep_alive 0), pinning (keep_alive -1) and downloading a model not on disk are an
admin's unless users are let; and a download is budgeted before it starts
(services/models/cache_budget.py, api/model_adding.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api import keys, on_demand
from api.config import ApiConfig
from api.errors import ApiError
from api.keys import Principal
from api.model_adding import require_room
from services.models.cache_budget import CacheSize, download_refusal
from services.models.catalogue import builtin_cards

GIB = 1024**3
USER = Principal("k1", "alice", "user")
ADMIN = Principal("k2", "root", "admin")


@pytest.fixture
def as_user() -> Iterator[None]:
    token = keys.PRINCIPAL.set(USER)
    yield
    keys.PRINCIPAL.reset(token)


def _config(**given: object) -> ApiConfig:
    return ApiConfig(nats_url="nats://x", db_url="sqlite://", **given)  # type: ignore[arg-type]


def test_a_user_key_may_not_pin_unload_or_download_by_default(as_user: None) -> None:
    """Once, a user key's keep_alive 0 unloaded an instance other keys streamed from, and
    naming any catalogue model downloaded it (up to 40 GB) and kept it with keep_alive -1."""
    admins = _config()
    assert not on_demand.may_change_the_cluster(admins)
    with pytest.raises(ApiError) as refused:
        on_demand.require_may_keep(admins, "m", -1.0)
    assert refused.value.status == 403 and "an admin must" in refused.value.message
    assert "--on-demand users" in refused.value.message
    with pytest.raises(ApiError) as refused:
        on_demand.require_may_keep(admins, "m", 0.0)  # unloaded after this request
    assert refused.value.status == 403 and "keep_alive 0" in refused.value.message
    on_demand.require_may_keep(admins, "m", 300.0)  # a keep-alive that ends: anyone's
    on_demand.require_may_keep(admins, "m", None)
    users = _config(on_demand="users")
    assert on_demand.may_change_the_cluster(users)
    on_demand.require_may_keep(users, "m", -1.0)


def test_an_admin_key_or_no_keys_may() -> None:
    assert on_demand.may_change_the_cluster(_config())  # no key: anonymous, an admin
    token = keys.PRINCIPAL.set(ADMIN)
    try:
        on_demand.require_may_keep(_config(), "m", -1.0)
    finally:
        keys.PRINCIPAL.reset(token)


def test_a_download_is_budgeted_before_it_starts() -> None:
    assert download_refusal("m", 4 * GIB, free=100 * GIB, budget=50 * GIB) is None
    over_budget = download_refusal("big", 40 * GIB, free=100 * GIB, budget=20 * GIB)
    assert over_budget is not None and "--cache-size" in over_budget
    over_disk = download_refusal("big", 40 * GIB, free=10 * GIB, budget=None)
    assert over_disk is not None and "free on the disk" in over_disk


def test_a_model_larger_than_the_cache_is_a_507_before_any_byte(tmp_path: Path) -> None:
    card = builtin_cards()["llama3.3-70b"]
    config = _config(models_dir=tmp_path / "models", cache_size=CacheSize(bytes=GIB))
    with pytest.raises(ApiError) as refused:
        require_room(config, card)
    assert refused.value.status == 507 and "llama3.3-70b" in refused.value.message
    require_room(_config(models_dir=tmp_path), builtin_cards()["smollm2-135m"])
