"""Requests Shoal refused (4xx) or failed (5xx), where an operator looks: a log line with the
route, the key's name and the reason, and ``shoal_http_requests_refused`` by route, status and
reason (the error's code: ``context_length_exceeded``, ``model_not_found``...; a field that is
not valid is ``invalid_request``). Each refusal is noted once, by the error handlers
(``api/errors.py``) or, for a stream whose tasks failed before it sent anything, by the stream
(``api/serving.py``)."""

from __future__ import annotations

import logging

from starlette.types import Scope

from api import keys
from api.errors import ApiError
from api.metrics import ApiMetrics, endpoint_of

log = logging.getLogger("api.refused")

# A reason for an error without a code of its own, by its status.
_REASONS = {
    400: "invalid_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "body_timeout",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
    503: "unavailable",
    504: "timeout",
}


def reason(err: ApiError) -> str:
    return err.code or _REASONS.get(err.status, "server_error" if err.status >= 500 else "refused")


def note(metrics: ApiMetrics, scope: Scope, err: ApiError) -> None:
    """Log and count ``err``, the answer to the request of ``scope``."""
    why = reason(err)
    level = logging.WARNING if err.status >= 500 else logging.INFO
    log.log(
        level,
        "refused %s %s (key %s): %d %s: %s",
        scope.get("method", "?"),
        scope.get("path", "?"),
        keys.current().name,
        err.status,
        why,
        err.message,
    )
    metrics.refused(endpoint_of(scope, ""), err.status, why)
