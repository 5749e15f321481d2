"""The dashboard: one page at ``/`` and its files under ``/static``.

Plain HTML, CSS and JavaScript shipped in the package (no build step). The page holds no data:
the browser calls the public API (``/v1/state``, ``/v1/events``...) with the user's key, so
the page and its files are served without one.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC = Path(__file__).parent / "static"

# Everything the page loads comes from this origin: an injected script could not run, nor
# send what it read elsewhere.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# Revalidated on every load (a cheap 304), so that an upgraded API never serves last
# version's script with this version's page.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=_HEADERS | {"Content-Security-Policy": _CSP})


class _Static(StaticFiles):
    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(_HEADERS)
        return response


def install(app: FastAPI) -> None:
    """Serve the page at ``/`` and its files at ``/static`` (neither in the OpenAPI document)."""
    app.include_router(router)
    app.mount("/static", _Static(directory=STATIC), name="static")
