"""``GET /metrics``: the scrape of ``api/metrics.py``, with this process's context."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import Response

from api.context import ApiContext, context, require_key
from api.metrics import CONTENT_TYPE, ApiMetrics, HttpMetrics, exposition

router = APIRouter(dependencies=[Depends(require_key)])


@router.get("/metrics", include_in_schema=False)
async def serve_metrics(ctx: Annotated[ApiContext, Depends(context)]) -> Response:
    """Prometheus metrics (text format 0.0.4); needs the API key when keys are configured."""
    text = await exposition(
        ctx.metrics, ctx.admission.snapshot(), ctx.engine, ctx.nc.jetstream(), ctx.config.projector
    )
    return Response(text, media_type=CONTENT_TYPE)


def install(app: FastAPI, metrics: ApiMetrics) -> None:
    """Count every request, and serve ``GET /metrics``."""
    app.add_middleware(HttpMetrics, metrics=metrics)
    app.include_router(router)
