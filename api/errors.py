"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error the API returns goes through here, so that OpenAI's SDKs raise their own error
classes (``BadRequestError`` for 400, ``AuthenticationError`` for 401, ``NotFoundError`` for
404...). FastAPI's own 422 list for an invalid body becomes one 400 that names the field.
"""

from __future__ import annotations

import logging
from typing import Any

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
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code), err.status, headers=headers
    )


_WHERE = {"body", "query", "path", "header"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return "the request body is missing: send a JSON object", None
    # A value that fits no branch of a union gives one error per branch ("stop.str",
    # "stop.list[str]"): the field is what all of them have in common.
    locs = [[str(p) for p in e.get("loc", ()) if p not in _WHERE] for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    param = ".".join(common) or None
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if len(locs) > 1 and len(common) < len(locs[0]):
        message = "not a valid value for this field (see the API reference for its type)"
    where = f"{param}: " if param else ""
    return f"{where}{message}", param


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param), 400)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return JSONResponse(error_body(exc.status_code, message), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(500, "internal error; the API's log has the details"), 500)
