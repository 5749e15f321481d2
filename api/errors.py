"""Errors in each client's own shape, chosen by the path the request came to:

- OpenAI (``/v1/...``): ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic (``/v1/messages...``): ``{"type": "error", "error": {"type", "message"}}``;
- Ollama (``/api/...``): ``{"error": "message"}``.

Every error the API returns goes through here, so that each SDK raises its own error classes
(``BadRequestError`` for 400, ``AuthenticationError`` for 401, ``NotFoundError`` for 404...).
FastAPI's own 422 list for an invalid body becomes one 400 that names the field.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "requests",  # what OpenAI sends for a limit on requests (with this code)
    503: "service_unavailable",
}

# A model's queue is full (api/admission.py): OpenAI's code for a 429.
QUEUE_FULL = "rate_limit_exceeded"


# Anthropic's error types by status (its SDK picks its exception class by the status).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",  # the body did not arrive in time (api/limits.py)
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Anthropic's type for an error of this code, where its status says otherwise: a full queue is
# the server's overload, not the account's rate limit (still a 429, which its SDK retries).
_ANTHROPIC_TYPES_BY_CODE = {QUEUE_FULL: "overloaded_error"}

Dialect = Literal["openai", "anthropic", "ollama"]


def dialect_of(path: str) -> Dialect:
    """Whose client calls this path, for the shape of its errors."""
    if path.startswith("/api/"):
        return "ollama"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    return "openai"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        said: Mapping[Dialect, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})  # sent with the error (a 429's Retry-After)
        # What a dialect's own API says instead, where clients act on its words.
        self.said = dict(said or {})

    def message_in(self, dialect: Dialect) -> str:
        return self.said.get(dialect, self.message)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES_BY_CODE.get(code or "") or _ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def dialect_error_body(err: ApiError, dialect: Dialect) -> dict[str, Any]:
    message = err.message_in(dialect)
    if dialect == "anthropic":
        return anthropic_error_body(err.status, message, err.code)
    if dialect == "ollama":
        return {"error": message}
    return error_body(err.status, message, err.param, err.code)


def error_response(err: ApiError, dialect: Dialect = "openai") -> JSONResponse:
    headers = ({"WWW-Authenticate": "Bearer"} if err.status == 401 else {}) | err.headers
    return JSONResponse(dialect_error_body(err, dialect), err.status, headers=headers or None)


_WHERE = {"body", "query", "path", "header"}
# A union's branches are named in an error's location by their type ("str", "list[str]",
# "function-after[...]", a model's class name); fields by their snake_case names, a list's
# items by their index and a dict's by their key ("[key]" after a key that is refused).
_TYPE = re.compile(r"[A-Z][A-Za-z0-9]*|[a-z-]+\[.*\]")
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _branch(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_NAMES or bool(_TYPE.fullmatch(part)))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first error's own message and field (a request with several unrelated errors
    gets the first, as OpenAI and Anthropic say one thing at a time). A value that fits no
    branch of a union gives one error per branch: the deepest branch's, when one went into
    the value, else "not a valid value" for the union's field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return "the request body is missing: send a JSON object", None
    # A check of Shoal's own (a schema too large, a tool's parameters not an object) says
    # what is wrong, and where: its message, not the union's.
    own = next((e for e in errors if e.get("type") == "value_error"), None)
    if own is not None:
        path = [str(p) for p in own.get("loc", ()) if p not in _WHERE and not _branch(p)]
        param = ".".join(path) or None
        message = str(own.get("msg", "invalid")).removeprefix("Value error, ")
        return (f"{param}: {message}" if param else message), param
    loc = tuple(first.get("loc", ()))
    at = next((i for i, part in enumerate(loc) if _branch(part)), None)
    chosen, vague = first, False
    if at is not None:
        branches = [
            e
            for e in errors
            if tuple(e.get("loc", ()))[:at] == loc[:at]
            and len(e.get("loc", ())) > at
            and _branch(e["loc"][at])
        ]
        chosen = max(branches, key=lambda e: len(e.get("loc", ())))
        vague = len(branches) > 1 and len(chosen.get("loc", ())) == at + 1
    path = [str(p) for p in chosen.get("loc", ()) if p not in _WHERE and not _branch(p)]
    param = ".".join(path) or None
    message = str(chosen.get("msg", "invalid")).removeprefix("Value error, ")
    if vague:
        message = "not a valid value for this field (see the API reference for its type)"
    where = f"{param}: " if param else ""
    return f"{where}{message}", param


# Told of every error answered (api/refusals.py logs and counts them).
Noted = Callable[[Request, ApiError], None]


def install(app: FastAPI, noted: Noted | None = None) -> None:
    def answer(request: Request, err: ApiError) -> JSONResponse:
        if noted is not None:
            noted(request, err)
        return error_response(err, dialect_of(request.url.path))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return answer(request, ApiError(400, message, param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return answer(request, ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return answer(request, ApiError(500, "internal error; the API's log has the details"))
