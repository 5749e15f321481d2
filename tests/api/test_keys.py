"""Keys, roles and per-key limits: the pure parts (api/keys.py, api/roles.py,
api/rate_limit.py) and the projection of keys and their usage."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.routing import Mount

from api.app import create_app
from api.config import ApiConfig
from api.keys import ANONYMOUS, CONFIGURED, Principal, key_digest, new_key, resolve
from api.rate_limit import RateLimits, retry_after
from api.roles import ROUTE_ROLES, allows, needed
from events.catalogue import KeyAdded, KeyRevoked, TaskCompleted, TaskCreated
from events.records import ChatMessage, Timings, Usage
from projectors.rows import KeyRow
from projectors.rules import fold

TS = datetime(2026, 1, 1, tzinfo=UTC)


def _row(key: str, role: str = "user") -> KeyRow:
    return KeyRow(
        key_id="k1",
        name="alice",
        role="user" if role == "user" else "admin",
        digest=key_digest(key),
    )


def test_a_key_is_known_by_its_digest_and_any_bytes_open_nothing() -> None:
    key = new_key()
    assert key.startswith("sk-shoal-") and len(key) == len("sk-shoal-") + 64
    made = {key_digest(key): _row(key)}
    assert resolve(key.encode(), frozenset(), made) == Principal("k1", "alice", "user")
    assert resolve(b"nope", frozenset(), made) is None
    assert resolve("café".encode(), frozenset(), made) is None  # not ASCII: still just a key
    assert resolve(b"\xff\xfe", frozenset({"root"}), made) is None
    assert resolve(b"", frozenset(), made) is None
    assert resolve(b"root", frozenset({"root"}), made) is CONFIGURED
    assert resolve(b"", frozenset(), {}) is ANONYMOUS  # no key at all: open, as before


def test_a_user_sees_its_own_and_an_admin_everything() -> None:
    alice = Principal("k1", "alice", "user")
    assert alice.sees("k1") and not alice.sees("k2") and not alice.sees(None)
    assert CONFIGURED.sees("k2") and ANONYMOUS.sees(None)


def test_routes_need_roles() -> None:
    assert needed("POST", "/v1/chat/completions") == "user"
    assert needed("GET", "/v1/events") == "admin"
    assert needed("HEAD", "/healthz") == "public"  # a HEAD as its GET
    assert needed("PATCH", "/v1/anything/new") == "admin"  # a route without an entry
    assert allows("user", "user") and allows("admin", "user") and allows("user", "public")
    assert not allows("user", "admin")
    assert set(ROUTE_ROLES.values()) == {"public", "user", "admin"}


def test_requests_and_tokens_a_minute() -> None:
    now = [0.0]
    limits = RateLimits(clock=lambda: now[0])
    assert limits.refusal("k", None, None) is None  # no limits: nothing counted
    assert [limits.refusal("k", 2, None) for _ in range(2)] == [None, None]
    wait = limits.refusal("k", 2, None)
    assert wait == 60.0 and retry_after(wait) == "60"
    now[0] = 60.5  # the first two left the window
    assert limits.refusal("k", 2, None) is None
    limits.used("k", 900)
    now[0] = 70.0
    assert limits.refusal("k", None, 1000) is None
    limits.used("k", 200)  # 1,100 in the window: over
    wait = limits.refusal("k", None, 1000)
    assert wait is not None and 0 < wait <= 50.5  # once the 900 (at 60.5) leave
    now[0] = 121.0
    assert limits.refusal("k", None, 1000) is None
    assert retry_after(0.2) == "1"


def test_keys_and_their_usage_are_projected() -> None:
    added = KeyAdded(
        key_id="k1", origin="cli", ts=TS, name="alice", digest="a" * 64, tokens_per_minute=10
    )
    task = TaskCreated(
        task_id="t1",
        model_id="m",
        origin="api",
        ts=TS,
        owner="k1",
        messages=[ChatMessage(role="user", content="hi")],
    )
    done = TaskCompleted(
        task_id="t1",
        model_id="m",
        origin="r",
        ts=TS,
        runner_id="r1",
        finish_reason="stop",
        usage=Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=4),
        timings=Timings(ttft_ms=1, tokens_per_s=1, total_ms=1),
    )
    state = fold([added, task, done, done])  # an outcome twice counts once
    row = state.api_key("k1")
    assert row is not None and row.role == "user" and row.tokens_per_minute == 10
    used = state.usage("k1", "m")
    assert used is not None and (used.requests, used.prompt_tokens) == (1, 10)
    assert (used.cached_tokens, used.completion_tokens) == (4, 5)
    state = fold([KeyRevoked(key_id="k1", origin="cli", ts=TS), added], state)
    revoked = state.api_key("k1")
    assert revoked is not None and revoked.revoked_at == TS  # and added again: still revoked


def _app_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD aside (a HEAD is its GET's)."""
    app = create_app(ApiConfig(nats_url="nats://127.0.0.1:1", db_url="sqlite:///unused.db"))
    found: set[tuple[str, str]] = set()
    stack: list[Any] = list(app.router.routes)
    while stack:
        route = stack.pop()
        if hasattr(route, "original_router"):  # FastAPI's included router
            stack.extend(route.original_router.routes)
        elif isinstance(route, Mount):
            found.add(("GET", route.path))  # static files
        else:
            found |= {(m, route.path) for m in route.methods if m != "HEAD"}
    return found


def test_every_route_has_a_role_in_the_table_and_in_the_docs() -> None:
    """A route added without an entry in api/roles.py fails here (it would be admin-only, by
    default), and so does a table in docs/api.md that says otherwise."""
    served = _app_routes()
    table = {k for k in ROUTE_ROLES if k[0] != "HEAD"}
    assert served - table == set(), "routes without a role in api/roles.py"
    assert table - served == set(), "roles for routes the app does not serve"
    docs = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    rows = dict(re.findall(r"^\| (public|user|admin) \| (.+) \|$", docs, re.MULTILINE))
    documented = {
        (method, path): role
        for role, routes in rows.items()
        for method, path in re.findall(r"`([A-Z]+) (\S+)`", routes)
    }
    assert documented == ROUTE_ROLES
