"""Which role each route needs: one table, checked on every request by ``context.require_key``
and against the app's routes by a test (a route without an entry fails it), and printed in
docs/api.md.

``public`` routes need no key (health, the dashboard's files, the OpenAPI document); ``user``
routes run inference and read what the key made; ``admin`` routes manage the cluster, its
models and keys, and read its events, state and metrics (every prompt and answer is there).
"""

from __future__ import annotations

from typing import Literal

from events.kinds import KeyRole

RouteRole = Literal["public", "user", "admin"]

ROUTE_ROLES: dict[tuple[str, str], RouteRole] = {
    # Health, the dashboard (it calls the API with the key its user gives), the API's document.
    ("GET", "/"): "public",
    ("GET", "/static"): "public",
    ("GET", "/health"): "public",
    ("GET", "/healthz"): "public",
    ("GET", "/openapi.json"): "public",
    ("GET", "/docs"): "public",
    ("GET", "/docs/oauth2-redirect"): "public",
    ("GET", "/redoc"): "public",
    ("GET", "/api/version"): "public",
    # Inference, and what a key made.
    ("POST", "/v1/chat/completions"): "user",
    ("POST", "/v1/completions"): "user",
    ("POST", "/v1/embeddings"): "user",
    ("POST", "/v1/images/generations"): "user",
    ("GET", "/v1/images/files/{name}"): "user",
    ("POST", "/v1/rerank"): "user",
    ("POST", "/rerank"): "user",
    ("POST", "/v1/messages"): "user",
    ("POST", "/v1/messages/count_tokens"): "user",
    ("GET", "/v1/models"): "user",
    ("GET", "/v1/models/{model}"): "user",
    ("POST", "/v1/responses"): "user",
    ("POST", "/v1/responses/input_tokens"): "user",
    ("GET", "/v1/responses/{response_id}"): "user",
    ("DELETE", "/v1/responses/{response_id}"): "user",
    ("POST", "/v1/responses/{response_id}/cancel"): "user",
    ("GET", "/v1/responses/{response_id}/input_items"): "user",
    ("POST", "/api/chat"): "user",
    ("POST", "/api/generate"): "user",
    ("POST", "/api/embed"): "user",
    ("POST", "/api/embeddings"): "user",
    ("GET", "/api/tags"): "user",
    ("GET", "/api/ps"): "user",
    ("POST", "/api/show"): "user",
    ("POST", "/tokenize"): "user",
    ("POST", "/detokenize"): "user",
    ("GET", "/tokenizer_info"): "user",
    # The cluster: instances, models, keys, its events and state.
    ("GET", "/v1/instances"): "admin",
    ("POST", "/v1/instances"): "admin",
    ("GET", "/v1/instances/{instance_id}"): "admin",
    ("DELETE", "/v1/instances/{instance_id}"): "admin",
    ("POST", "/v1/placement/preview"): "admin",
    ("GET", "/v1/state"): "admin",
    ("GET", "/v1/events"): "admin",
    ("GET", "/v1/admission"): "admin",
    ("GET", "/metrics"): "admin",
    ("POST", "/api/pull"): "admin",
    ("POST", "/api/push"): "admin",
    ("POST", "/api/create"): "admin",
    ("POST", "/api/copy"): "admin",
    ("DELETE", "/api/delete"): "admin",
    ("POST", "/api/delete"): "admin",
    ("GET", "/api/blobs/{blob}"): "admin",
    ("HEAD", "/api/blobs/{blob}"): "admin",
    ("POST", "/api/blobs/{blob}"): "admin",
}

_RANK: dict[RouteRole, int] = {"public": 0, "user": 1, "admin": 2}


def needed(method: str, path: str) -> RouteRole:
    """The role a route needs: its entry (a HEAD as its GET), else admin."""
    found = ROUTE_ROLES.get((method, path))
    if found is None and method == "HEAD":
        found = ROUTE_ROLES.get(("GET", path))
    return found if found is not None else "admin"


def allows(role: KeyRole, route: RouteRole) -> bool:
    return _RANK[role] >= _RANK[route]
